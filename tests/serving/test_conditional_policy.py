"""The driver's conditional-disaggregation policy: which decode worker holds the state a prompt extends,
and whether the cost model (or the flag) lets it prefill the new tokens there."""

from __future__ import annotations

import pytest

from distpool.memory.prefix import CacheNews, StateKey, chained_block_keys
from distpool.serving.routing.conditional import ConditionalOptions, LocalPrefillPolicy, Sizes
from distpool.serving.routing.router import AFFINITY_SLACK, Router
from tests.factories import finished_news

MIB = 1 << 20
SIZES = Sizes(slot_bytes=100 * MIB, page_bytes=MIB // 4, page_size=16)
TURN_ONE = list(range(1, 101))


def policy(**options) -> LocalPrefillPolicy:
    router = Router(["prefill-0"], ["decode-0", "decode-1"], page_size=16)
    return LocalPrefillPolicy(router, SIZES, ConditionalOptions(**options))


def measured(
    p: LocalPrefillPolicy,
    *,
    link_gbps: float = 1.0,
    tokens_per_s: float = 10_000,
    tpot_s: float = 0.02,
    model_tokens_per_s: float = 0.0,
    landing_s: float = 0.1,
):
    """A completed remote request: prefill's rate `tokens_per_s` (waiting included), its model's
    `model_tokens_per_s` (0: not reported), its envelope's `landing_s` (landed to in the batch)."""
    p.measured(
        transfer_bytes=int(link_gbps * 1e9),
        transfer_s=1.0,
        computed_tokens=int(tokens_per_s),
        prefill_s=1.0,
        tpot_s=tpot_s,
        compute_tokens_per_s=model_tokens_per_s,
        landing_s=landing_s,
    )


def test_a_later_turn_goes_to_the_worker_holding_its_state():
    p = policy(max_tokens=1000)
    p.router.learned("decode-1", finished_news(TURN_ONE, 16))
    assert p.choose(TURN_ONE + [7, 8, 9], 16, set()) == ("decode-1", 100)
    assert p.choose([5] + TURN_ONE, 16, set()) is None  # does not extend it
    assert p.choose(TURN_ONE, 16, set()) is None  # the last token must be computed: not a proper prefix
    assert p.choose(TURN_ONE + [7], 16, {"decode-1"}) is None  # avoided after a failure there
    for prompt in (TURN_ONE + [7, 8, 9], TURN_ONE, TURN_ONE[:33], [5] + TURN_ONE):  # keys known: same answer
        keys = chained_block_keys(prompt, 16)
        assert p.choose(prompt, 16, set(), keys) == p.choose(prompt, 16, set())


def test_a_later_turn_supersedes_and_an_evicted_state_is_gone():
    p = policy(max_tokens=1000)
    p.router.learned("decode-0", finished_news(TURN_ONE, 16))
    turn_two = TURN_ONE + list(range(200, 250))
    p.router.learned("decode-0", finished_news(turn_two, 16, dropped=[TURN_ONE]))
    assert p.router.views["decode-0"].keys().states == {StateKey.of(turn_two, 16)}
    assert p.choose(turn_two + [1], 16, set()) == ("decode-0", len(turn_two))
    assert p.choose(TURN_ONE + [1], 16, set()) is None  # its state went with turn two
    p.router.learned("decode-0", CacheNews(dropped_states=(StateKey.of(turn_two, 16),)))  # evicted
    assert p.choose(turn_two + [1], 16, set()) is None


def test_nothing_goes_local_before_the_run_measured_the_link_and_the_rates():
    p = policy()
    p.router.learned("decode-0", finished_news(TURN_ONE, 16))
    assert not p.allows(64, 0, 16) and p.choose(TURN_ONE + [1] * 64, 16, set()) is None
    p.measured_locally(500, 0.01, admit_s=0.01)  # decode is fast, but the remote path is unmeasured
    assert p.estimate(64, 0, 16) is None and not p.allows(64, 0, 16)
    p.measured(transfer_bytes=10**9, transfer_s=1.0, computed_tokens=1000, prefill_s=1.0, tpot_s=0.02)
    assert p.estimate(64, 0, 16) is None  # every remote figure but the landing
    measured(p)
    assert p.allows(64, 0, 16)


def move_s(new_tokens: int, link_bytes_per_s: float = 1e9) -> float:
    return (SIZES.slot_bytes + (-(-new_tokens // 16) + 1) * SIZES.page_bytes) / link_bytes_per_s


def test_local_wins_when_decode_computes_the_new_tokens_before_the_remote_path_would_deliver_them():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=1_000, tpot_s=1.0)  # a generous latency budget
    p.measured_locally(500, 1.0)  # decode computes at half prefill's rate
    # local (N / 500) <= remote (N / 1,000 + move): N <= 1,000 * move_s, about 106 tokens
    assert p.allows(100, 0, 16) and not p.allows(120, 0, 16)
    assert 100 / 500 <= 100 / 1_000 + move_s(100) and 120 / 500 > 120 / 1_000 + move_s(120)
    p.router.learned("decode-0", finished_news(TURN_ONE, 16))
    assert p.choose(TURN_ONE + [1] * 100, 16, set()) == ("decode-0", 100)
    assert p.choose(TURN_ONE + [1] * 120, 16, set()) is None


def test_where_decode_computes_as_fast_as_prefill_only_the_latency_budget_bounds_it():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=10_000, tpot_s=0.01)  # budget: 0.5 * 10 ms * 16 = 80 ms
    p.measured_locally(10_000, 1.0)  # admission measured by the landing: the same verification
    assert p.allows(800, 0, 16) and not p.allows(801, 0, 16)  # 800 tokens in 80 ms
    assert p.allows(1_600, 0, 32)  # a longer reply spreads the delay over more steps
    assert p.allows(801, 0, 16, batch_running=False)  # nothing else on that worker: nothing stalls


def test_queued_tokens_delay_the_turn_but_do_not_stall_the_batch_again():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=10_000, tpot_s=0.01)
    p.measured_locally(10_000, 1.0)
    # The batch waits for the queued prefills whichever path this turn takes: they count in its
    # TTFT (local: Q / 10,000 + 400 / 10,000 <= remote: 400 / 10,000 + move), not in its stall.
    assert p.allows(400, 800, 16)
    assert 800 / 10_000 <= move_s(400) and 1_200 / 10_000 > move_s(400)
    assert not p.allows(400, 1_200, 16)


def test_prefills_model_rate_stands_in_for_decodes_until_a_local_prefill_completed():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=1_000, tpot_s=1.0)
    assert not p.allows(64, 0, 16)  # no rate for decode at all: disaggregated
    measured(p, link_gbps=1.0, tokens_per_s=1_000, tpot_s=1.0, model_tokens_per_s=8_000)
    assert p.decode_s.at(400) is None and p.model_tokens_per_s.value == 8_000
    # Prefill waits and batches at 1,000 tokens/s; its model computes at 8,000: four turns queued at
    # once on one decode worker all go local, (N + Q) / 8,000 <= N / 1,000 + move.
    p.router.learned("decode-0", finished_news(TURN_ONE, 16))
    for queued in (0, 400, 800, 1_200):
        assert p.allows(400, queued, 16)
    p.measured_locally(500, 2.0)  # decode turned out slow: its own seconds replace the stand-in
    assert not p.allows(400, 0, 16)


# Bamba's public config at --context-len 16384 and 3 GiB (a 117.4 MiB slot, 12 KiB of KV per token)
BAMBA = Sizes(slot_bytes=123_104_768, page_bytes=196_608, page_size=16)


def bamba_multi_turn_measured() -> LocalPrefillPolicy:
    """The policy after the turns of `distpool run --model tests/fixtures/bamba.json --model-impl
    synthetic --workload multi-turn --turns 8 --requests 16 --context-len 16384 --memory-gib 3`
    (16-token replies) on a loaded 2-core CPU: the figures that run measured."""
    p = LocalPrefillPolicy(Router(["prefill-0"], ["decode-0"], page_size=16), BAMBA, ConditionalOptions())
    # The two first turns, moved: 928 and 167 prompt tokens in 0.65 s each (batched together), 1.8 GB/s,
    # landed to verified (every byte of a 117 MiB slot) and in the batch in 0.47 and 0.12 s.
    for tokens, landing_s in ((928, 0.47), (167, 0.12)):
        p.measured(
            transfer_bytes=130 << 20,
            transfer_s=0.073,
            computed_tokens=tokens,
            prefill_s=0.65,
            tpot_s=0.033,
            compute_tokens_per_s=2_057,
            landing_s=landing_s,
        )
    # Later turns prefilled on decode: new tokens, decode's seconds (the kept state's copy, 30-100 ms,
    # then 26 ms or more per chunk of up to 512 tokens), admission (the same verification)
    for tokens, compute_s, admit_s in (
        (106, 0.062, 0.102),
        (338, 0.065, 0.088),
        (641, 0.098, 0.107),
        (96, 0.065, 0.129),
        (290, 0.062, 0.185),
        (233, 0.084, 0.074),
        (118, 0.078, 0.148),
        (667, 0.162, 0.211),
        (813, 0.103, 0.183),
    ):
        p.measured_locally(tokens, compute_s, admit_s)
    return p


def test_a_short_reply_and_a_large_slot_go_local_where_that_is_faster():
    p = bamba_multi_turn_measured()
    p.router.learned("decode-0", finished_news(TURN_ONE, 16))
    p.router.in_flight["decode-0"] = 1  # the other conversation's turn runs there
    # (new tokens, tokens queued there): the turns that run asked for next, and a short one behind a long one
    asked = ((670, 813), (790, 670), (910, 790), (468, 910), (301, 468), (64, 1_024))
    for new_tokens, queued_tokens in asked:
        estimate = p.estimate(new_tokens, queued_tokens, 16)
        assert estimate is not None and estimate.local_s < estimate.remote_s  # faster locally
        # Running requests wait for it about as long as for its landing: the budget of a 16-token
        # reply (0.5 * 33 ms * 16 = 264 ms) is not what decides.
        assert estimate.stall_s < 0.05 < estimate.budget_s < 0.3
        assert p.allows(new_tokens, queued_tokens, 16)
        p.queued_tokens["decode-0"] = queued_tokens
        assert p.choose(TURN_ONE + [1] * new_tokens, 16, set()) == ("decode-0", 100)
    # A decode worker that turned out slow (2 s per local prefill) loses to the moved envelope.
    for _ in range(20):
        p.measured_locally(900, 2.0, admit_s=0.12)
    estimate = p.estimate(910, 0, 16)
    assert estimate is not None and estimate.local_s > estimate.remote_s
    assert estimate.stall_s > estimate.budget_s
    assert not p.allows(910, 0, 16) and not p.allows(910, 0, 16, batch_running=False)


def test_one_short_local_prefill_does_not_make_a_queue_of_long_ones_look_slow():
    # The benchmark's multi-turn run (4 conversations, 32-token replies): four first turns moved, then
    # the first local prefill, 106 tokens in 167 ms (mostly the state copy and one chunk's fixed
    # cost), while three second turns (2,051 tokens) are queued there and a third turn asks.
    p = LocalPrefillPolicy(Router(["prefill-0"], ["decode-0"], page_size=16), BAMBA, ConditionalOptions())
    for tokens, landing_s in ((928, 0.44), (167, 0.20), (962, 0.26), (949, 0.09)):
        p.measured(
            transfer_bytes=130 << 20,
            transfer_s=0.065,
            computed_tokens=tokens,
            prefill_s=1.16,
            tpot_s=0.075,
            compute_tokens_per_s=5_571,
            landing_s=landing_s,
        )
    p.measured_locally(106, 0.167, admit_s=0.126)
    # Read as a rate (635 tokens/s), the queue looked like 4.4 s against the remote path's 1.5 s; with
    # prefill's model computing the part per token (5,571 tokens/s) and the sample the fixed part:
    fixed_s = 0.167 - 106 / 5_571
    estimate = p.estimate(641, 2_051, 32)
    assert estimate is not None
    assert estimate.local_s == pytest.approx(2 * fixed_s + (2_051 + 641) / 5_571 + 0.126)
    assert estimate.local_s < 1.0 < 1.5 < estimate.remote_s
    assert p.allows(641, 2_051, 32)


def test_the_model_rate_standing_in_for_decode_bounds_the_ttft_not_the_stall():
    # The run's first turn moved (928 tokens, prefill's model at 2,000 tokens/s, 20 ms per token: a
    # 16-token reply's budget is 160 ms); no local prefill has completed yet.
    p = LocalPrefillPolicy(Router(["prefill-0"], ["decode-0"], page_size=16), BAMBA, ConditionalOptions())
    p.measured(
        transfer_bytes=130 << 20,
        transfer_s=0.1,
        computed_tokens=928,
        prefill_s=0.66,
        tpot_s=0.02,
        compute_tokens_per_s=2_000,
        landing_s=0.58,
    )
    estimate = p.estimate(338, 106, 16)
    assert estimate is not None and not estimate.stall_measured
    assert estimate.local_s < estimate.remote_s and estimate.stall_s > estimate.budget_s
    assert p.allows(338, 106, 16)  # the stand-in's 169 ms of stall does not send it remote
    p.measured_locally(106, 0.5, admit_s=0.13)  # decode's own: half a second for 106 tokens
    estimate = p.estimate(338, 0, 16)
    assert estimate is not None and estimate.stall_measured and estimate.stall_s > estimate.budget_s
    assert not p.allows(338, 0, 16) and p.allows(338, 0, 16, batch_running=False)


def test_decodes_seconds_are_a_part_per_prefill_and_a_part_per_token_not_a_rate():
    p = policy()
    assert p.decode_s.at(100) is None
    p.measured_locally(100, 0.06)
    assert p.decode_s.at(1_000) == pytest.approx(0.6)  # one sample: a rate
    p.measured_locally(1_000, 0.15)  # 50 ms each, then 0.1 ms per token
    assert p.decode_s.at(100) == pytest.approx(0.06) and p.decode_s.at(1_000) == pytest.approx(0.15)
    assert p.decode_s.at(2_000) == pytest.approx(0.25)
    for _ in range(10):  # longer prefills measured faster: no negative part per token, the mean
        p.measured_locally(2_000, 0.05)
    assert p.decode_s.at(0) == p.decode_s.at(2_000) == pytest.approx(p.decode_s.y.value)
    p = policy()
    p.measured_locally(1_000, 1.0)
    p.measured_locally(100, 0.001)  # a line through both would cost less than nothing at 0 tokens
    assert p.decode_s.at(0) == 0.0 and p.decode_s.at(1_000) == pytest.approx(0.9975, abs=1e-4)


def test_queued_local_work_and_load_count():
    p = policy(max_tokens=100)
    p.router.learned("decode-0", finished_news(TURN_ONE, 16))
    prompt = TURN_ONE + [1] * 60
    p.queued_tokens["decode-0"] = 50  # another local prefill still computing there
    assert p.choose(prompt, 16, set()) is None
    p.queued_tokens["decode-0"] = 0
    p.router.in_flight["decode-0"] = AFFINITY_SLACK + 1  # far busier than decode-1
    assert p.choose(prompt, 16, set()) is None


def test_a_bound_below_one_token_is_refused():
    with pytest.raises(ValueError, match="--local-prefill-max-tokens must be at least 1"):
        ConditionalOptions(max_tokens=0)
