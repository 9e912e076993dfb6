"""TP groups under faults and rank loss on Ray: a shard damaged on one decode rank only fails the
request as corrupt on every rank and it is retried; a prefill group that loses a rank (kill -9, or
stopped and continued) comes back as one and the run completes, exit 3, nothing leaked.

One deployment per TP layout serves this module's runs one after the other (faults first, then the
rank losses that restart its ranks), to keep the module's CI time down."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from distpool.serving.deploy import deployment as deployment_module
from distpool.serving.deploy.deployment import Deployment, DeploymentSpec
from distpool.serving.job.main import drop_prefix_caches, exit_status, worker_stats
from distpool.serving.path.driver import ServeOptions, Server
from distpool.serving.path.faults import CORRUPT_ONE_RANK
from distpool.serving.summary.parity import Parity
from distpool.serving.summary.report import summarize
from distpool.worker.stats import DecodeStats
from tests.factories import tp_spec
from tests.serving.helpers import mixed_requests, tp_worker
from transfer.faults import SENDER_ABORT

pytestmark = pytest.mark.ray
SILENCE_S = 2.0  # a stopped rank is noticed after this and a ping
STOP_S = 12.0  # how long a prefill rank stays stopped: past its loss, and its group's take-down


@pytest.fixture(scope="module")
def deployment(ray_session, request):
    """A deployment at (prefill TP, decode TP) `request.param`: module-scoped, so pytest runs the
    tests of one layout together on it and shuts it down before starting the next."""
    # A transfer timeout past STOP_S: a rank waiting in a collective on a stopped one does not give
    # up (and restart) by itself before the stopped one resumes, as with the CLI's default.
    worker = tp_worker(tp_spec("mamba2_groups1"), *request.param, transfer_timeout_s=STOP_S + 8)
    # Room for a few requests at once: the others wait for a reservation on decode, and some get it
    # while a lost prefill group is restarting (their prefill must not reach its new ranks then).
    pool_args = dataclasses.replace(worker.pool_args, max_running_requests=4)
    spec = DeploymentSpec.build(dataclasses.replace(worker, pool_args=pool_args))
    # Ray's restart budget is per worker and run; this deployment serves two rank-loss runs (and a
    # take-down restarts every rank of the group, again if forming fails under load), so it gets
    # two runs' budget: the second strike must not find the first one's restarts used up.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deployment_module, "MAX_RESTARTS", 2 * deployment_module.MAX_RESTARTS)
        started = Deployment.start(spec)
    yield started
    started.shutdown()


def serve(
    deployment: Deployment, requests, options: ServeOptions, strikes: Callable[[Server], None] | None = None
) -> tuple[Server, dict, list]:
    """Serve `requests` on a thread while `strikes(server)` runs on this one; the server, the run's
    summary (every rank read, prefix caches dropped: what is held then is a leak) and each rank's
    reading."""
    server = Server(deployment, options)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(requests)), daemon=True)
    thread.start()
    if strikes is not None:
        strikes(server)
    thread.join(timeout=180)
    assert not thread.is_alive(), "serving hung"
    stats = drop_prefix_caches(deployment, worker_stats(deployment, lost=server.router.dead))
    worker = deployment.spec.worker
    report = summarize(
        server.outcomes,
        retried=server.retried,
        worker_stats=stats,
        parity=Parity(),
        wall_s=1.0,
        workers_lost=len(server.recovery.lost),
        workers_restarted=len(server.recovery.restarted),
        model_impl="synthetic",
        tp=(worker.prefill_tp, worker.decode_tp),
    )
    return server, report, stats


@pytest.mark.parametrize("deployment", [(2, 1), (1, 2), (2, 2)], ids=["2to1", "1to2", "2to2"], indirect=True)
def test_faults_with_one_decode_rank_corrupt_complete_every_request_retried(deployment):
    """`--fault-rate 0.3`: transfers aborted, and one byte flipped in one decode rank's shard only
    (the other ranks' shards verify). Every request completes, each verified on every decode rank
    (no corrupt envelope accepted), the corrupt attempts retried, and nothing is held at the end."""
    faults = {SENDER_ABORT: 0.15, CORRUPT_ONE_RANK: 0.15}
    # A fault is drawn per attempt, before its reservation; an attempt that finds no room on decode
    # (4 requests at once here) ends before its transfer and leaves its plan untaken. So a run may
    # draw corruption without one striking: serve again (other seeds) until one struck.
    for run, seed in enumerate((4, 5, 6)):
        requests = mixed_requests(10, max_new_tokens=3, seed=13 + run, max_prompt=40)
        options = ServeOptions(progress=False, faults=faults, max_attempts=10, seed=seed, silence_s=SILENCE_S)
        server, report, stats = serve(deployment, requests, options)
        assert report["completed"] == 10, report["errors"]
        assert report["verified_envelopes"] == 10 and report["corrupt_envelopes"] == 0
        assert server.faults.struck[CORRUPT_ONE_RANK] <= server.faults.injected[CORRUPT_ONE_RANK]
        if server.faults.struck[CORRUPT_ONE_RANK]:
            break
    assert server.faults.struck[CORRUPT_ONE_RANK] > 0 and server.retried > 0
    decode = [w.stats for w in stats if isinstance(w.stats, DecodeStats)]
    assert sum(s.corrupt_envelopes for s in decode) > 0  # the damaged shards were caught, then retried
    assert report["retries_by_reason"].get("corrupt", 0) > 0  # and the summary says so
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    assert exit_status(report) == 0


def pid_of(deployment: Deployment, rank: str) -> int:
    import ray

    return ray.get(deployment.rank_handles()[rank].pid.remote(), timeout=30)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


@pytest.mark.parametrize("deployment", [(2, 1), (2, 2)], ids=["2to1", "2to2"], indirect=True)
def test_a_prefill_group_that_loses_a_rank_comes_back_and_the_run_completes_with_exit_3(deployment):
    """Regression: a `--prefill-tp 2` worker that lost a rank never came back. A stopped rank
    (kill -STOP) was not taken down with its group and resumed in a group that was gone, and a
    prefill call that reached a new rank before the group formed (queued while Ray restarted it,
    or made by a request that had chosen the worker before it was lost) made that life exit
    "computed before its group formed" and broke the forming; every request after the loss failed.
    Now, after a stop/continue and after a kill -9 of one prefill rank, the whole group restarts,
    forms anew, the requests are retried, every one completes, and the run exits 3 (a worker was
    lost) with nothing leaked on any rank. Two runs on one deployment: a stop, then a kill."""
    stopped: list[int] = []

    def stop(server: Server) -> None:
        wait_for(lambda: server.done >= 3, "3 requests done")
        stopped.append(pid_of(deployment, "prefill-0.1"))
        os.kill(stopped[0], signal.SIGSTOP)
        time.sleep(STOP_S)
        with contextlib.suppress(ProcessLookupError):  # the group's take-down killed it meanwhile
            os.kill(stopped[0], signal.SIGCONT)

    def kill(server: Server) -> None:
        wait_for(lambda: server.done >= 3, "3 requests done")
        os.kill(pid_of(deployment, "prefill-0.0"), signal.SIGKILL)

    options = ServeOptions(progress=False, max_attempts=8, silence_s=SILENCE_S)
    try:
        for seed, strike in [(19, stop), (17, kill)]:
            requests = mixed_requests(16, max_new_tokens=4, seed=seed, max_prompt=40)
            server, report, _ = serve(deployment, requests, options, strike)
            assert report["completed"] == 16, (strike.__name__, report["errors"])
            assert server.recovery.lost == server.recovery.restarted == ["prefill-0"], strike.__name__
            assert report["verified_envelopes"] == 16 and report["corrupt_envelopes"] == 0
            assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
            assert exit_status(report) == 3
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
