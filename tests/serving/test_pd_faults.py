"""Dead actors and refusals under PD serving: failures are bounded, retried, and leak nothing."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.deploy.deployment import Deployment, DeploymentSpec
from distpool.serving.job.main import worker_stats
from distpool.serving.path.driver import ServeOptions, Server
from distpool.serving.summary.parity import Parity, colocated_tokens
from distpool.worker.stats import DecodeStats
from tests.factories import FIXTURES
from tests.serving import helpers
from tests.serving.helpers import mixed_requests

pytestmark = pytest.mark.ray
CONFIGS = REFERENCE_HYBRID_CONFIG.parent
TRANSFER_TIMEOUT_S = 3.0


def make_spec(**changes) -> DeploymentSpec:
    return helpers.make_spec(transfer_timeout_s=TRANSFER_TIMEOUT_S, **changes)


def serve_and_strike(spec: DeploymentSpec, requests, *, until, strike, silence_s: float | None = None):
    """Serve `requests` on a thread; once `until(server)` holds, `strike(deployment)` (a kill, a stop).
    Returns the server (its `outcomes`), every worker's stats as the summary gathers them (a dead or
    silent one must not break that) and the seconds from the strike to the end of serving."""
    deployment = Deployment.start(spec)
    server = Server(deployment, ServeOptions(progress=False, max_attempts=6, silence_s=silence_s))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(requests)))
    try:
        started = time.monotonic()
        thread.start()
        while not until(server) and thread.is_alive() and time.monotonic() - started < 60:
            time.sleep(0.01)
        assert until(server), "the moment to strike never came"
        strike(deployment)
        struck = time.monotonic()
        thread.join(timeout=150)
        assert not thread.is_alive(), "serving hung after the strike"
        after_s = time.monotonic() - struck
        stats = worker_stats(deployment, lost=server.router.dead)
    finally:
        deployment.shutdown()
    return server, stats, after_s


def pid_of(deployment: Deployment, name: str) -> int:
    import ray

    return ray.get(deployment.handles()[name].pid.remote())


@pytest.mark.parametrize(
    "victim, layout", [("decode-0", dict(num_decode=2)), ("prefill-0", dict(num_prefill=2))]
)
def test_killing_a_worker_mid_run_retries_on_the_survivor(ray_session, victim, layout):
    import ray

    spec = make_spec(**layout)
    requests = mixed_requests(24, max_new_tokens=24, seed=11)
    server, stats, after_kill_s = serve_and_strike(
        spec,
        requests,
        until=lambda server: server.router.in_flight[victim] > 0,
        strike=lambda deployment: ray.kill(deployment.handles()[victim]),  # for good: no restart
    )
    outcomes = server.outcomes
    assert all(o.tokens is not None for o in outcomes), [o.error for o in outcomes if o.tokens is None]
    assert {o.request_id: o.tokens for o in outcomes} == colocated_tokens(spec, requests)
    # A peer blocked on the dead one fails within its transfer deadline; the rest is ordinary work.
    assert after_kill_s < 60
    assert victim in server.router.dead
    states = {w.name: w.state for w in stats}
    assert states[victim] == "dead" and list(states.values()).count("alive") == len(states) - 1
    for w in stats:
        if w.name != victim:  # the dead one's figures are unknown (None), not zero
            assert (w.stats.pages_used, w.stats.slots_used) == (0, 0), w


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distpool", "run", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "config, expected",
    [("reference-dense.json", "not hybrid"), ("reference-swa.json", "sliding-window band")],
)
def test_refusals_exit_2_before_any_actor_exists(config, expected):
    started = time.monotonic()
    proc = run_cli("--model", str(CONFIGS / config), "--enable-unified-memory")
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "--enable-unified-memory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr.replace("--enable-unified-memory", "")  # never started
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    "config, expected",
    [("qwen3_next.json", "hybrid Mamba2 models only"), ("nemotron_h.json", "small configs only")],
)
def test_models_the_reference_model_cannot_run_are_refused_before_ray_starts(config, expected):
    fixture = FIXTURES / config
    proc = run_cli("--model", str(fixture), "--memory-gib", "2", "--model-impl", "reference")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr and "--model-impl synthetic" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Started a local Ray" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "victim, layout, num_requests",
    [("prefill-0", dict(num_prefill=2, num_decode=2), 300), ("decode-0", dict(), 120)],
)
def test_a_killed_worker_process_is_restarted_and_the_run_ends_honestly(
    ray_session, victim, layout, num_requests
):
    """kill -9 of a worker process (one prefill of 2P2D, or the only decode of 1P1D): Ray restarts
    it, the driver rebuilds its channels, at least 90% of the requests complete within 60 s of the
    kill, and nothing leaks."""
    spec = make_spec(**layout)
    requests = mixed_requests(num_requests, max_new_tokens=24, seed=21)  # long enough to see the restart
    server, stats, after_kill_s = serve_and_strike(
        spec,
        requests,
        until=lambda server: server.done >= 20,
        strike=lambda deployment: os.kill(pid_of(deployment, victim), signal.SIGKILL),
    )
    completed = [o for o in server.outcomes if o.tokens is not None]
    assert len(completed) >= 0.9 * len(requests), {o.error for o in server.outcomes if o.tokens is None}
    assert after_kill_s < 60
    assert server.recovery.lost == [victim] and server.recovery.restarted == [victim]
    assert all(w.state == "alive" for w in stats)  # the restarted worker answers too
    for w in stats:
        assert (w.stats.pages_used, w.stats.slots_used) == (0, 0), w
    got = {o.request_id: o.tokens for o in completed}
    expected = colocated_tokens(spec, [r for r in requests if r.request_id in got][:20])
    assert all(got[rid] == tokens for rid, tokens in expected.items())


def test_a_restarted_decode_workers_first_life_still_counts_in_the_summary(ray_session):
    """Regression: kill -9 of a decode worker that had verified envelopes; Ray restarted it with its
    counters at zero, and the summary (which summed the workers' own counters) read "verified 176"
    of 200 completed and exited 1 instead of 3. The driver now counts what each result reported."""
    from distpool.serving.job.main import exit_status
    from distpool.serving.summary.report import summarize
    from tests.serving.test_pd_synthetic import synthetic_spec

    spec = synthetic_spec(num_prefill=1, num_decode=2)
    requests = mixed_requests(60, max_new_tokens=6, seed=31, max_prompt=120)
    server, stats, _ = serve_and_strike(
        spec,
        requests,
        until=lambda server: sum(o.pair == ("prefill-0", "decode-0") for o in server.outcomes) >= 5,
        strike=lambda deployment: os.kill(pid_of(deployment, "decode-0"), signal.SIGKILL),
    )
    assert server.recovery.lost == ["decode-0"]
    report = summarize(
        server.outcomes,
        retried=server.retried,
        worker_stats=stats,
        parity=Parity(),
        wall_s=1.0,
        workers_lost=len(server.recovery.lost),
        workers_restarted=len(server.recovery.restarted),
        model_impl="synthetic",
    )
    assert report["completed"] == len(requests), report["errors"]
    # The workers' own counters lost decode-0's first life; the summary did not.
    decode = [w.stats for w in stats if isinstance(w.stats, DecodeStats)]
    assert sum(s.verified_envelopes for s in decode) < report["completed"]
    assert report["verified_envelopes"] == report["completed"]
    assert exit_status(report) == 3


def test_a_stopped_decode_worker_is_lost_and_routed_around(ray_session):
    """Regression: kill -STOP of one decode worker of 2P2D stalled the run for ~110 s (its
    reservations were awaited without a deadline), then a third of the requests failed "not
    admitted within 60 s" while the other decode worker had room. Now its silence is noticed (a call
    unanswered for `silence_s`, then a ping), it is lost like a dead one, and the run goes on."""
    spec = make_spec(num_prefill=2, num_decode=2)
    requests = mixed_requests(60, max_new_tokens=12, seed=41)
    stopped = []

    def stop(deployment) -> None:
        stopped.append(pid_of(deployment, "decode-1"))
        os.kill(stopped[0], signal.SIGSTOP)

    try:
        server, stats, after_stop_s = serve_and_strike(
            spec,
            requests,
            until=lambda server: server.done >= 10 and server.router.in_flight["decode-1"] > 0,
            strike=stop,
            silence_s=2.0,
        )
    finally:
        for pid in stopped:  # Ray's shutdown may have killed it already
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    failed = [o.error for o in server.outcomes if o.tokens is None]
    assert not failed, failed
    assert server.recovery.lost == ["decode-1"]
    assert server.recovery.why["decode-1"].startswith("stopped answering")
    assert after_stop_s < 60  # detection takes silence_s + a ping; the rest is ordinary work
    assert {w.name: w.state for w in stats}["decode-1"] == "not answering"
