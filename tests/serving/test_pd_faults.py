"""Dead actors and refusals under PD serving: failures are bounded, retried, and leak nothing."""

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.deployment import Deployment, DeploymentSpec
from distpool.serving.driver import ServeOptions, Server
from distpool.serving.parity import colocated_tokens
from distpool.serving.run import worker_stats
from tests.factories import FIXTURES
from tests.serving import helpers
from tests.serving.helpers import mixed_requests

pytestmark = pytest.mark.ray
CONFIGS = REFERENCE_HYBRID_CONFIG.parent
TRANSFER_TIMEOUT_S = 3.0


def make_spec(**changes) -> DeploymentSpec:
    return helpers.make_spec(transfer_timeout_s=TRANSFER_TIMEOUT_S, **changes)


def serve_and_kill(spec: DeploymentSpec, victim: str, requests):
    """Serve in a thread; kill `victim` for good once it has work in flight; return outcomes, every
    worker's stats (the dead one listed as dead), the server and the seconds from kill to end."""
    import ray

    deployment = Deployment.start(spec)
    server = Server(deployment, ServeOptions(progress=False, max_attempts=6))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", asyncio.run(server.serve(requests))))
    try:
        started = time.monotonic()
        thread.start()
        while server.router.in_flight[victim] == 0 and time.monotonic() - started < 30:
            time.sleep(0.01)
        assert server.router.in_flight[victim] > 0, f"{victim} never got work"
        ray.kill(deployment.handles()[victim])
        killed = time.monotonic()
        thread.join(timeout=120)
        assert not thread.is_alive(), "serving hung after a worker died"
        stats = worker_stats(deployment)  # the summary's own gathering: a dead worker must not break it
    finally:
        deployment.shutdown()
    return result["out"], stats, server, time.monotonic() - killed


@pytest.mark.parametrize(
    "victim, layout", [("decode-0", dict(num_decode=2)), ("prefill-0", dict(num_prefill=2))]
)
def test_killing_a_worker_mid_run_retries_on_the_survivor(ray_session, victim, layout):
    spec = make_spec(**layout)
    requests = mixed_requests(24, max_new_tokens=24, seed=11)
    outcomes, stats, server, after_kill_s = serve_and_kill(spec, victim, requests)
    assert all(o.tokens is not None for o in outcomes), [o.error for o in outcomes if o.tokens is None]
    assert {o.request_id: o.tokens for o in outcomes} == colocated_tokens(spec, requests)
    # A peer blocked on the dead one fails within its transfer deadline; the rest is ordinary work.
    assert after_kill_s < 60
    assert victim in server.router.dead
    assert {s["name"]: s["state"] for s in stats}[victim] == "dead"
    for s in stats:
        assert (s["pages_used"], s["slots_used"]) == (0, 0), s


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
    assert time.monotonic() - started < 30


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
    import os
    import signal

    import ray

    spec = make_spec(**layout)
    requests = mixed_requests(num_requests, max_new_tokens=24, seed=21)  # long enough to see the restart
    deployment = Deployment.start(spec)
    server = Server(deployment, ServeOptions(progress=False, max_attempts=6))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", asyncio.run(server.serve(requests))))
    try:
        pid = ray.get(deployment.handles()[victim].pid.remote())
        thread.start()
        while server.done < 20 and thread.is_alive():
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        thread.join(timeout=120)
        assert not thread.is_alive(), "serving hung after a worker died"
        after_kill_s = time.monotonic() - killed
        stats = worker_stats(deployment)
    finally:
        deployment.shutdown()
    completed = [o for o in result["out"] if o.tokens is not None]
    assert len(completed) >= 0.9 * len(requests), {o.error for o in result["out"] if o.tokens is None}
    assert after_kill_s < 60
    assert server.recovery.lost == [victim] and server.recovery.restarted == [victim]
    assert all(s["state"] == "alive" for s in stats)  # the restarted worker answers too
    for s in stats:
        assert (s["pages_used"], s["slots_used"]) == (0, 0), s
    got = {o.request_id: o.tokens for o in completed}
    expected = colocated_tokens(spec, [r for r in requests if r.request_id in got][:20])
    assert all(got[rid] == tokens for rid, tokens in expected.items())
