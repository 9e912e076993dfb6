"""PD serving end to end on a local Ray cluster: parity with colocated generation and the oracle,
and every pool back to empty afterwards."""

import pytest
import torch

from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.model import ReferenceModel
from distpool.serving.path.faults import RECEIVER_CANCEL
from distpool.serving.summary.parity import colocated_tokens
from distpool.serving.summary.report import failures_by_reason
from distpool.serving.workloads.workload import Request
from tests.serving.helpers import make_spec, mixed_requests, serve
from transfer import FailureKind
from transfer.faults import DELAY_CONTROL, SENDER_ABORT

pytestmark = pytest.mark.ray
# The NCCL variant places each worker on its own GPU through a placement group.
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu2, two_gpus])]


def assert_drained(stats):
    for s in stats:
        assert (s.pages_used, s.slots_used) == (0, 0), s


@pytest.mark.parametrize("device", DEVICES)
def test_1p1d_unified_matches_colocated_and_no_cache_oracle(ray_session, device):
    spec = make_spec(device=device)
    requests = mixed_requests(10, max_new_tokens=6)
    outcomes, stats, server = serve(spec, requests)
    got = {o.request_id: o.tokens for o in outcomes}
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert got == colocated_tokens(spec, requests)
    oracle = ReferenceModel(spec.worker.spec, seed=spec.worker.seed)
    for r in requests[:4]:
        assert got[r.request_id] == oracle.generate_nocache(r.prompt, r.max_new_tokens)
    assert server.retried == 0
    assert_drained(stats)
    assert all(o.transfer_bytes > 0 for o in outcomes)


def test_2p2d_static_pools_use_every_worker(ray_session):
    spec = make_spec(num_prefill=2, num_decode=2, unified=False)
    requests = mixed_requests(16, max_new_tokens=5, seed=3)
    outcomes, stats, _ = serve(spec, requests)
    assert {o.request_id: o.tokens for o in outcomes} == colocated_tokens(spec, requests)
    assert_drained(stats)
    assert all(s.pages_peak > 0 for s in stats), "a worker received no request"


def test_fault_rate_retries_every_failed_transfer_without_leaks(ray_session):
    spec = make_spec()
    requests = mixed_requests(12, max_new_tokens=3, seed=5)
    outcomes, stats, server = serve(spec, requests, faults={SENDER_ABORT: 0.4}, max_attempts=10, seed=1)
    assert all(o.tokens is not None for o in outcomes), [o.error for o in outcomes]
    assert server.retried > 0
    assert {o.request_id: o.tokens for o in outcomes} == colocated_tokens(spec, requests)
    assert_drained(stats)


def test_a_request_aborted_on_every_attempt_fails_as_aborted(ray_session):
    """The kind travels: the sender's abort -> prefill's PrefillFailed.kind -> the driver's retry ->
    the outcome, and the summary counts it by kind. (Seed 6 draws a fault for each of its first 30
    attempts at 0.99.)"""
    spec = make_spec()
    requests = mixed_requests(3, max_new_tokens=2, seed=9)
    outcomes, stats, server = serve(spec, requests, faults={SENDER_ABORT: 0.99}, max_attempts=2, seed=6)
    assert [(o.failure, o.attempts) for o in outcomes] == [(FailureKind.ABORTED, 2)] * 3
    assert server.retried == 3 and not any(o.corrupt for o in outcomes)
    assert failures_by_reason(outcomes) == {"aborted": 3}
    assert_drained(stats)


def test_reservations_refused_while_prefill_computes_are_retried_without_leaks(ray_session):
    """The driver reserves the destination while prefill computes. A decode pool of about three
    requests refuses many reservations with prefill already on its way: prefill's transfer is
    refused, both sides free what they took, and the request is tried again. With faults on top
    (transfers aborted, reservations given up mid-way, streams held back), every request
    completes with the colocated tokens and every pool's accounting holds (`stats` checks it)."""
    spec = make_spec(budget_bytes=400 << 10)
    requests = mixed_requests(24, max_new_tokens=16, seed=7)
    faults = {SENDER_ABORT: 0.1, RECEIVER_CANCEL: 0.1, DELAY_CONTROL: 0.1}
    outcomes, stats, server = serve(spec, requests, faults=faults, max_attempts=12, seed=2)
    assert all(o.tokens is not None for o in outcomes), [o.error for o in outcomes]
    assert {o.request_id: o.tokens for o in outcomes} == colocated_tokens(spec, requests)
    # Refused at least once; the first refusal came while prefill ran (no refusal was remembered yet).
    assert "decode-0" in server.reservations.refused_at
    assert server.retried > 0
    assert_drained(stats)


def test_single_token_prompt_and_single_new_token(ray_session):
    spec = make_spec()
    requests = [Request(request_id="one", prompt=[7], params=SamplingParams(max_tokens=1))]
    outcomes, stats, _ = serve(spec, requests)
    assert outcomes[0].tokens == colocated_tokens(spec, requests)["one"]
    assert len(outcomes[0].tokens) == 1
    assert_drained(stats)


def test_a_second_server_on_the_same_deployment_gets_every_result(ray_session):
    """Each `serve` waits for its result long-polls to return: one left behind took the next
    server's results and handed them to nobody (that server then waited forever)."""
    import asyncio

    import ray

    from distpool.serving.deploy.deployment import Deployment
    from distpool.serving.path.driver import ServeOptions, Server

    spec = make_spec()
    deployment = Deployment.start(spec)
    try:
        for round_ in range(3):
            requests = mixed_requests(2, max_new_tokens=3, seed=round_)
            server = Server(deployment, ServeOptions(progress=False, queue_bound=1))
            outcomes = asyncio.run(asyncio.wait_for(server.serve(requests), timeout=60))
            assert [o.tokens for o in outcomes] == [
                colocated_tokens(spec, requests)[r.request_id] for r in requests
            ]
        assert_drained(ray.get([h.stats.remote() for h in deployment.handles().values()]))
    finally:
        deployment.shutdown()


def test_spread_over_more_workers_than_nodes_is_refused_with_the_node_count(ray_session):
    """An attached cluster's nodes are counted before placement: a spread it cannot hold once
    waited 60 s and ended in a GetTimeoutError traceback."""
    from distpool.serving.deploy import TooFewNodes
    from distpool.serving.deploy.deployment import Deployment

    with pytest.raises(TooFewNodes) as caught:
        Deployment.start(make_spec(spread=True))
    assert (caught.value.workers, caught.value.nodes) == (2, 1)
