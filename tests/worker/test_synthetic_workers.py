"""Workers with the synthetic cache: decode verifies every received byte before a request joins its
batch, and again before release; a damaged envelope fails its request as corrupt, holding nothing."""

from __future__ import annotations

import dataclasses

import pytest

from decode.request import BAD_PROMPT, RequestRefused
from distpool.memory.sizing import PoolArgs
from distpool.model.sampling import SamplingParams
from distpool.model.spec import DENSE, HYBRID_MAMBA, HYBRID_SWA
from distpool.serving.deploy.deployment import DeploymentSpec
from distpool.serving.summary.parity import colocated_tokens
from distpool.serving.workloads.workload import Request
from distpool.worker.config import WorkerConfig
from distpool.worker.messages import DecodeFailed, PrefillSent
from tests.factories import make_spec
from tests.worker.test_workers import assert_nothing_held, make_pair, prefill_one, serve, wait_finished
from transfer import FailureKind, TransferOptions
from transfer.faults import CORRUPT_PAYLOAD

PROMPTS = {"a": list(range(1, 30)), "b": [7, 7, 7], "c": list(range(50, 90))}


def synthetic_config(kind: str = HYBRID_MAMBA, *, unified: bool = True) -> WorkerConfig:
    spec = make_spec(kind, num_layers=6, kv_heads=2, head_dim=16, conv_shape=(3, 64), ssm_shape=(4, 16, 16))
    return WorkerConfig(
        spec=spec,
        pool_args=PoolArgs(enable_unified_memory=unified, page_size=4, context_len=128),
        budget_bytes=2 << 20,
        transfer=TransferOptions(timeout_s=5),
        model_impl="synthetic",
    )


@pytest.fixture
def pair():
    p, d = make_pair(config=synthetic_config())
    yield p, d
    p.shutdown()
    d.shutdown()


def colocated(config: WorkerConfig, prompts: dict[str, list[int]], max_new_tokens: int) -> dict:
    requests = [
        Request(request_id=rid, prompt=p, params=SamplingParams(max_tokens=max_new_tokens))
        for rid, p in prompts.items()
    ]
    return colocated_tokens(DeploymentSpec(worker=config), requests)


@pytest.mark.parametrize(
    "kind, unified", [(HYBRID_MAMBA, True), (HYBRID_MAMBA, False), (HYBRID_SWA, False), (DENSE, False)]
)
def test_every_envelope_verifies_and_tokens_match_colocated(kind, unified):
    config = synthetic_config(kind, unified=unified)
    p, d = make_pair(config=config)
    try:
        sent = serve(p, d, PROMPTS, 6)
        assert {type(r) for r in sent.values()} == {PrefillSent}
        done = wait_finished(d, list(PROMPTS))
        assert {rid: r.tokens for rid, r in done.items()} == colocated(config, PROMPTS, 6)
        stats = d.stats()
        assert (stats.verified_envelopes, stats.corrupt_envelopes) == (3, 0)
        assert all(r.destination_runs >= 1 and r.admit_s >= 0 for r in done.values())
        assert_nothing_held(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_an_attention_free_model_is_served_with_slot_only_envelopes():
    """Pure Mamba2: no page band at all. Each envelope is its state slot; releasing one once
    indexed the empty page band and killed the decode loop."""
    spec = make_spec(DENSE, attention_free=True, conv_shape=(3, 64), ssm_shape=(4, 16, 16))
    config = dataclasses.replace(
        synthetic_config(), spec=spec, pool_args=PoolArgs(page_size=4, context_len=128)
    )
    p, d = make_pair(config=config)
    try:
        sent = serve(p, d, PROMPTS, 6)
        assert {type(r) for r in sent.values()} == {PrefillSent}
        assert {r.transfer_bytes for r in sent.values()} == {spec.slot_bytes}  # the slot, nothing else
        done = wait_finished(d, list(PROMPTS), timeout_s=10)
        assert {rid: r.tokens for rid, r in done.items()} == colocated(config, PROMPTS, 6)
        assert (d.stats().verified_envelopes, d.stats().pages_capacity) == (3, 0)
        assert_nothing_held(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def fails_as_corrupt(d, rid: str, where: str) -> None:
    result = wait_finished(d, [rid])[rid]
    assert isinstance(result, DecodeFailed)  # no tokens handed out
    assert result.kind is FailureKind.CORRUPT and result.corrupt
    assert where in result.reason  # which check found it: the reason names the part and the moment
    assert d.stats().corrupt_envelopes == 1


def test_a_byte_flipped_on_landing_fails_the_request_as_corrupt(pair):
    p, d = pair
    d.plan_fault("x", CORRUPT_PAYLOAD)  # the checksum is off
    d.reserve("x", PROMPTS["a"], SamplingParams(max_tokens=4), "prefill-0")
    assert isinstance(prefill_one(p, "x", PROMPTS["a"]), PrefillSent)
    fails_as_corrupt(d, "x", "received")
    assert_nothing_held(p, d)


def damage_on_landing(d, damage) -> None:
    """Run `damage(pool, request_id, ranges)` on the destination bytes after the transfer wrote them
    and before decode verifies them."""
    landed = d._landed

    def patched(parts):  # every transfer of the request concluded
        with d.lock:
            rid = parts.request_id
            if parts.error is None:
                damage(d.pool, rid, d.pool.envelope_ranges(rid))
        landed(parts)

    d._landed = patched


def swap_pages(pool, rid, ranges):
    (a, n), (b, _) = ranges[1].tolist(), ranges[2].tolist()  # row 0 is the slot
    first = pool.buffer[a : a + n].clone()
    pool.buffer[a : a + n] = pool.buffer[b : b + n]
    pool.buffer[b : b + n] = first


def truncate(pool, rid, ranges):
    offset, nbytes = ranges[-1].tolist()  # the last page never arrived
    pool.buffer[offset : offset + nbytes] = 0


@pytest.mark.parametrize("damage", [swap_pages, truncate], ids=["swapped page", "truncated"])
def test_damaged_landings_fail_as_corrupt_with_nothing_held(pair, damage):
    p, d = pair
    damage_on_landing(d, damage)
    d.reserve("x", PROMPTS["c"], SamplingParams(max_tokens=4), "prefill-0")
    assert isinstance(prefill_one(p, "x", PROMPTS["c"]), PrefillSent)
    fails_as_corrupt(d, "x", "received")
    assert_nothing_held(p, d)


def test_a_stale_slot_fails_as_corrupt(pair):
    """The slot keeps an earlier request's state (its write was lost): decode notices."""
    p, d = pair
    serve(p, d, {"earlier": PROMPTS["b"]}, 2)
    wait_finished(d, ["earlier"])
    stale = {}

    def keep_stale(pool, rid, ranges):
        offset, nbytes = ranges[0].tolist()
        pool.buffer[offset : offset + nbytes] = stale["bytes"]

    damage_on_landing(d, keep_stale)  # before the reservation: its transfer calls back what it saw
    d.reserve("x", PROMPTS["a"], SamplingParams(max_tokens=4), "prefill-0")
    offset, nbytes = d.pool.envelope_ranges("x")[0].tolist()
    stale["bytes"] = d.pool.buffer[offset : offset + nbytes].clone()  # what "earlier" left behind
    assert isinstance(prefill_one(p, "x", PROMPTS["a"]), PrefillSent)
    fails_as_corrupt(d, "x", "state")
    assert_nothing_held(p, d)


def test_damage_while_decoding_is_caught_before_release(pair):
    """A neighbour's write (or a broken compaction) after admission: the release check fails it."""
    p, d = pair
    landed = d.arrivals.verify

    def then_damage():
        rids = list(d.arrived)
        landed()
        for rid in rids:
            if rid in d.running:
                offset, _ = d.pool.envelope_ranges(rid)[1].tolist()
                d.pool.buffer[offset] ^= 0x5A  # the first page's first byte

    d.arrivals.verify = then_damage
    serve(p, d, {"x": PROMPTS["a"]}, 8)
    fails_as_corrupt(d, "x", "at release")
    assert d.stats().verified_envelopes == 1
    assert_nothing_held(p, d)


def test_hostile_prompts_and_first_tokens_hold_nothing_and_keep_the_loop_alive(pair):
    p, d = pair
    for prompt in ([-1, 2], [1, 10**9], [1.5], "abc"):
        with pytest.raises(RequestRefused) as refused:
            d.reserve("bad", prompt, SamplingParams(max_tokens=2), "prefill-0")
        assert (refused.value.problem, refused.value.vocab_size) == (BAD_PROMPT, d.model.vocab_size)
    assert_nothing_held(d)
    original = d._landed

    def wrong_first_token(parts):
        parts.transfers[0].first_token = 10**9  # outside the vocabulary: what a broken peer could send
        original(parts)

    d._landed = wrong_first_token
    d.reserve("x", PROMPTS["b"], SamplingParams(max_tokens=3), "prefill-0")
    assert isinstance(prefill_one(p, "x", PROMPTS["b"]), PrefillSent)
    fails_as_corrupt(d, "x", "received")
    d._landed = original
    assert isinstance(serve(p, d, {"y": PROMPTS["a"]}, 3)["y"], PrefillSent)  # the decode loop lives on
    assert len(wait_finished(d, ["y"])["y"].tokens) == 3
    assert_nothing_held(p, d)
