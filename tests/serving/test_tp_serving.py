"""Workers as tensor-parallel groups on Ray: every rank serves its shard of every request, each
envelope is verified on every decode rank, and a rank that dies takes its group down and back as one."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest

from distpool.memory.sizing import PoolArgs
from distpool.model.hf_config import spec_from_hf
from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.serving.deploy.deployment import DeploymentSpec
from distpool.serving.job.main import exit_status, run
from distpool.serving.summary.parity import colocated_tokens
from distpool.worker.config import WorkerConfig
from tests.factories import FIXTURES, tp_spec
from tests.serving.helpers import mixed_requests, tp_worker
from tests.serving.test_pd_faults import serve_and_strike
from transfer import TransferOptions

pytestmark = pytest.mark.ray


def served(spec: DeploymentSpec, requests, tmp_path, *, parity_sample: int) -> dict:
    """`distpool run`'s JSON report of serving `requests`, which must have exited 0."""
    path = tmp_path / "run.json"
    status = run(spec, requests, address=None, parity_sample=parity_sample, json_path=str(path))
    report = json.loads(path.read_text())
    assert status == exit_status(report) == 0, report["errors"]
    return report


def bamba_spec(prefill_tp: int, decode_tp: int) -> DeploymentSpec:
    """Bamba's public config at its true sizes (a 117 MiB slot: 59 MiB per rank at TP 2), with the
    synthetic cache, on 256 MiB per rank."""
    spec = spec_from_hf(FIXTURES / "bamba.json")
    return DeploymentSpec.build(
        tp_worker(spec, prefill_tp, decode_tp, page_size=16, context_len=256, budget_bytes=256 << 20)
    )


def test_tp2_to_tp2_serves_every_request_verified_on_every_rank(ray_session, tmp_path):
    spec = bamba_spec(2, 2)
    requests = mixed_requests(4, max_new_tokens=3, seed=3, max_prompt=100)
    report = served(spec, requests, tmp_path, parity_sample=2)
    assert (report["prefill_tp"], report["decode_tp"]) == (2, 2)
    assert report["completed"] == 4 and report["verified_envelopes"] == 4
    assert report["corrupt_envelopes"] == 0 and report["parity_mismatches"] == 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    # each decode rank received its own half of every envelope
    by_rank = report["transfer_bytes_by_rank"]
    assert len(by_rank) == 2 and by_rank[0] == by_rank[1] > 0
    assert sum(by_rank) == report["transfer_bytes"]
    workers = {w["name"]: w for w in report["workers"]}
    assert set(workers) == {"prefill-0.0", "prefill-0.1", "decode-0.0", "decode-0.1"}
    for rank in ("decode-0.0", "decode-0.1"):  # every rank checked every byte of its shard
        assert workers[rank]["verified_envelopes"] == 4 and workers[rank]["corrupt_envelopes"] == 0


def small_tp_spec(tp: int) -> DeploymentSpec:
    """A small Mamba2 hybrid (one group: B and C replicated on both ranks) at TP `tp` on both sides."""
    return DeploymentSpec.build(tp_worker(tp_spec("mamba2_groups1"), tp, tp, transfer_timeout_s=5))


def test_a_killed_decode_rank_takes_its_group_down_and_back_and_every_request_completes(ray_session):
    """kill -9 of one rank of a `--decode-tp 2` worker: its group is lost, both decode ranks are
    restarted (as one), the requests it held are retried, and the run completes every request,
    each verified on both decode ranks, with nothing leaked on any rank."""
    import ray

    spec = small_tp_spec(2)
    requests = mixed_requests(16, max_new_tokens=8, seed=5, max_prompt=60)

    def kill_one_rank(deployment) -> None:
        os.kill(ray.get(deployment.rank_handles()["decode-0.1"].pid.remote(), timeout=30), signal.SIGKILL)

    server, stats, after_kill_s = serve_and_strike(
        spec, requests, until=lambda server: server.done >= 3, strike=kill_one_rank
    )
    failed = [o.error for o in server.outcomes if o.tokens is None]
    assert not failed, failed
    assert len(server.outcomes) == 16 and all(o.verified for o in server.outcomes)
    assert {o.request_id: o.tokens for o in server.outcomes} == colocated_tokens(spec, requests)
    assert server.recovery.lost == ["decode-0"] and server.recovery.restarted == ["decode-0"]
    assert after_kill_s < 90
    assert all(w.state == "alive" for w in stats) and len(stats) == 4
    for w in stats:  # every rank, the restarted ones too: nothing leaked
        assert (w.stats.pages_used, w.stats.slots_used) == (0, 0), w
    # Both decode ranks started afresh together: each verified exactly what the group served since,
    # fewer than the run (the rank not killed would otherwise count its first life's too).
    verified = {w.name: w.stats.verified_envelopes for w in stats if w.name.startswith("decode")}
    assert verified["decode-0.0"] == verified["decode-0.1"] < 16, verified


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2), (2, 4)], ids=["2to1", "1to2", "2to4"])
def test_across_tp_sizes_every_envelope_is_verified_on_every_decode_rank(ray_session, tmp_path, sizes):
    """Each decode rank receives its shard from the prefill ranks holding it (B and C of the one
    Mamba2 group replicated on every rank), over one channel per source rank, and verifies every
    byte of it; the tokens are those of TP 1."""
    spec = DeploymentSpec.build(tp_worker(tp_spec("mamba2_groups1"), *sizes))
    requests = mixed_requests(4, max_new_tokens=3, seed=9, max_prompt=60)
    report = served(spec, requests, tmp_path, parity_sample=2)
    assert (report["prefill_tp"], report["decode_tp"]) == sizes
    assert report["completed"] == report["verified_envelopes"] == 4 and report["corrupt_envelopes"] == 0
    assert report["parity_checked"] == 2 and report["parity_mismatches"] == 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    by_rank = report["transfer_bytes_by_rank"]
    assert len(by_rank) == sizes[1] and min(by_rank) > 0 and sum(by_rank) == report["transfer_bytes"]
    decode_ranks = [w for w in report["workers"] if w["role"] == "decode"]
    assert len(decode_ranks) == sizes[1]
    assert all(w["verified_envelopes"] == 4 and w["corrupt_envelopes"] == 0 for w in decode_ranks)


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_the_reference_model_served_across_tp_sizes_gives_the_tokens_of_tp_1(ray_session, tmp_path, sizes):
    """The reference model all-reduces over each group's ranks, which prefill and decode in lockstep:
    state prefilled at one TP size decodes at the other to the colocated TP 1 run's tokens, greedy
    or sampled."""
    spec = DeploymentSpec.build(
        WorkerConfig(
            spec=spec_from_hf(REFERENCE_HYBRID_CONFIG),
            pool_args=PoolArgs(page_size=4, context_len=128, prefix_cache=True),
            budget_bytes=8 << 20,
            transfer=TransferOptions(timeout_s=10),
            model_impl="reference",
            prefill_tp=sizes[0],
            decode_tp=sizes[1],
        )
    )
    requests = mixed_requests(12, max_new_tokens=6, seed=11, max_prompt=60)
    # Half of them sampled: every rank draws the same token, at either TP size, as colocated TP 1.
    sampled = SamplingParams(max_tokens=6, temperature=1.2, top_p=0.9, top_k=30)
    requests = [r if i % 2 else dataclasses.replace(r, params=sampled) for i, r in enumerate(requests)]
    report = served(spec, requests, tmp_path, parity_sample=12)
    assert (report["prefill_tp"], report["decode_tp"]) == sizes
    assert report["completed"] == 12 and report["parity_checked"] == 12
    assert report["parity_mismatches"] == 0 and report["parity_near_ties"] == 0
    assert (report["leaked_pages"], report["leaked_slots"]) == (0, 0)
    assert len(report["transfer_bytes_by_rank"]) == sizes[1]
