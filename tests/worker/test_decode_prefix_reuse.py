"""Decode-side prefix reuse: a finished request's full pages stay in the decode worker's cache, and
the next turn that starts with them reserves them by reference, so its transfer moves only the rest
of its pages and the state slot. Tokens and bytes are those of a run without any cache."""

from __future__ import annotations

import dataclasses

import pytest

from distpool.model.sampling import SamplingParams
from distpool.model_impl.reference.model import ReferenceModel
from distpool.worker.config import WorkerConfig
from distpool.worker.messages import DecodeFinished, PrefillSent
from distpool.worker.stats import PoolHeld
from tests.worker.test_synthetic_workers import synthetic_config
from tests.worker.test_workers import (
    ARGS,
    SPEC,
    assert_nothing_held,
    make_pair,
    prefill_one,
    serve,
    wait_finished,
)
from transfer import FailureKind, TransferOptions
from transfer.faults import CORRUPT_PAYLOAD

PAGE_SIZE = ARGS.page_size  # 4
FIRST = list(range(3, 25))  # 22 tokens
MAX_NEW = 6
EVICTION_BUDGET = 256 << 10  # about 200 pages: 20 finished requests of 60 tokens cache more than that


def reference_config(*, prefix_cache: bool = True, budget_bytes: int = 4 << 20) -> WorkerConfig:
    return WorkerConfig(
        spec=SPEC,
        pool_args=dataclasses.replace(ARGS, prefix_cache=prefix_cache),
        budget_bytes=budget_bytes,
        transfer=TransferOptions(timeout_s=5),
    )


def two_turns(config: WorkerConfig, fault: str | None = None) -> tuple[list[dict], list[dict], dict]:
    """Serve turn 1, then turn 2 = turn 1's prompt + its reply + a new message, on one pair: what
    prefill sent and what decode finished, per turn, and decode's stats."""
    p, d = make_pair(config=config)
    try:
        sent1 = serve(p, d, {"t1": FIRST}, MAX_NEW)["t1"]
        done1 = wait_finished(d, ["t1"])["t1"]
        second = FIRST + done1.tokens + [40, 41, 42, 43, 44, 45, 46]
        sent2 = serve(p, d, {"t2": second}, MAX_NEW, fault=fault)["t2"]
        done2 = wait_finished(d, ["t2"])["t2"]
        assert_nothing_held(p, d)  # cached pages are the cache's alone
        stats = d.stats()
        assert p.drop_prefix_cache() == d.drop_prefix_cache() == PoolHeld(pages_used=0, slots_used=0)
        return [sent1, sent2], [done1, done2, {"prompt": second}], stats
    finally:
        p.shutdown()
        d.shutdown()


def test_the_next_turn_moves_only_the_pages_decode_does_not_hold():
    sent, done, stats = two_turns(reference_config())
    sent_plain, done_plain, _ = two_turns(reference_config(prefix_cache=False))
    # Decode held turn 1's prompt and its reply but the last token: 22 + 5 = 27 tokens, 6 full pages.
    held_pages = (len(FIRST) + MAX_NEW - 1) // PAGE_SIZE
    assert done[1].prefix_hit_tokens == held_pages * PAGE_SIZE
    assert done[0].prefix_hit_tokens == done_plain[1].prefix_hit_tokens == 0
    page_bytes = (sent_plain[1].transfer_bytes - sent_plain[0].transfer_bytes) // (
        -(-len(done[2]["prompt"]) // PAGE_SIZE) - -(-len(FIRST) // PAGE_SIZE)
    )
    assert sent[0].transfer_bytes == sent_plain[0].transfer_bytes
    assert sent[1].transfer_bytes == sent_plain[1].transfer_bytes - held_pages * page_bytes
    # The same tokens as without any cache, and as the oracle.
    oracle = ReferenceModel(SPEC)
    assert [r.tokens for r in done[:2]] == [r.tokens for r in done_plain[:2]]
    assert done[1].tokens == oracle.generate_nocache(done[2]["prompt"], MAX_NEW)
    # Decode keeps pages, and no checkpoint at a page boundary: only turn 2's final state (turn 1's
    # was superseded by it), with its partial page.
    assert stats.cached_pages > 0 and stats.checkpoints == 1 and stats.decode_state_checkpoints == 2


def test_synthetic_envelopes_verify_byte_for_byte_after_reuse():
    config = synthetic_config()
    plain = dataclasses.replace(config, pool_args=dataclasses.replace(config.pool_args, prefix_cache=False))
    sent, done, stats = two_turns(config)
    sent_plain, done_plain, _ = two_turns(plain)
    assert done[1].prefix_hit_tokens > 0 and sent[1].transfer_bytes < sent_plain[1].transfer_bytes
    assert [r.tokens for r in done[:2]] == [r.tokens for r in done_plain[:2]]
    # Verified on arrival (the held pages included) and again before release, both turns.
    assert (stats.verified_envelopes, stats.corrupt_envelopes) == (2, 0)


def test_a_corrupted_transfer_never_touches_the_held_prefix():
    """The fault flips the first byte the transfer writes; the held pages are not among them, so
    decode's cached prefix still verifies for the request's retry."""
    config = synthetic_config()
    p, d = make_pair(config=config)
    try:
        serve(p, d, {"t1": FIRST}, MAX_NEW)
        tokens = wait_finished(d, ["t1"])["t1"].tokens
        second = FIRST + tokens + [40, 41, 42]
        d.plan_fault("t2", CORRUPT_PAYLOAD)
        d.reserve("t2", second, SamplingParams(max_tokens=MAX_NEW), "prefill-0")
        assert isinstance(prefill_one(p, "t2", second), PrefillSent)
        result = wait_finished(d, ["t2"])["t2"]
        assert result.kind is FailureKind.CORRUPT
        assert result.mismatch.kind == "state"  # which part was found wrong: the slot, checked first
        retry = serve(p, d, {"t2": second}, MAX_NEW)["t2"]
        assert isinstance(retry, PrefillSent)
        again = wait_finished(d, ["t2"])["t2"]
        assert isinstance(again, DecodeFinished) and again.prefix_hit_tokens > 0
        assert (d.stats().verified_envelopes, d.stats().corrupt_envelopes) == (2, 1)
    finally:
        p.shutdown()
        d.shutdown()


def test_admission_evicts_idle_cached_pages_instead_of_refusing():
    """A decode pool full of cached prefixes still admits new requests: idle cached pages go."""
    p, d = make_pair(config=reference_config(budget_bytes=EVICTION_BUDGET))
    try:
        finished = 0
        for i in range(20):  # distinct prompts: each leaves its full pages cached
            rid, prompt = f"r{i}", [i % 50 + 1] * 40
            if isinstance(serve(p, d, {rid: prompt}, 20)[rid], PrefillSent):
                finished += len(wait_finished(d, [rid]))
        stats = d.stats()
        assert finished == 20 and stats.evicted_pages > 0
        assert stats.pages_used == 0 and stats.cached_pages > 0
        # A request that needs most of the pool: admitted by evicting what the cache holds.
        big = list(range(50, 90)) * 2
        assert isinstance(serve(p, d, {"big": big}, 40)["big"], PrefillSent)
        assert isinstance(wait_finished(d, ["big"])["big"], DecodeFinished)
        assert d.drop_prefix_cache() == PoolHeld(pages_used=0, slots_used=0)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_no_reuse_without_a_shared_prefix(prefix_cache):
    p, d = make_pair(config=reference_config(prefix_cache=prefix_cache))
    try:
        serve(p, d, {"a": FIRST}, MAX_NEW)
        wait_finished(d, ["a"])
        serve(p, d, {"b": [90] + FIRST}, MAX_NEW)  # shifted by one token: no page matches
        assert wait_finished(d, ["b"])["b"].prefix_hit_tokens == 0
    finally:
        p.shutdown()
        d.shutdown()
