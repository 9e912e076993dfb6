"""The driver's conditional-disaggregation policy: which decode worker holds the state a prompt extends,
and whether the cost model (or the flag) lets it prefill the new tokens there."""

from __future__ import annotations

import pytest

from distpool.serving.conditional import ConditionalOptions, LocalPrefillPolicy, Sizes
from distpool.serving.router import AFFINITY_SLACK, Router

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
):
    """A completed remote request: prefill's rate `tokens_per_s` (waiting included), its model's
    `model_tokens_per_s` (0: not reported)."""
    p.measured(
        transfer_bytes=int(link_gbps * 1e9),
        transfer_s=1.0,
        computed_tokens=int(tokens_per_s),
        prefill_s=1.0,
        tpot_s=tpot_s,
        compute_tokens_per_s=model_tokens_per_s,
    )


def test_a_later_turn_goes_to_the_worker_holding_its_state():
    p = policy(max_tokens=1000)
    p.remember("decode-1", TURN_ONE)
    assert p.choose(TURN_ONE + [7, 8, 9], 16, set()) == ("decode-1", 100)
    assert p.choose([5] + TURN_ONE, 16, set()) is None  # does not extend it
    assert p.choose(TURN_ONE, 16, set()) is None  # the last token must be computed: not a proper prefix
    assert p.choose(TURN_ONE + [7], 16, {"decode-1"}) is None  # avoided after a failure there


def test_a_later_turn_supersedes_and_a_refusal_forgets():
    p = policy(max_tokens=1000)
    p.remember("decode-0", TURN_ONE)
    turn_two = TURN_ONE + list(range(200, 250))
    p.remember("decode-0", turn_two)
    assert list(p.states["decode-0"]) == [tuple(turn_two)]
    p.forget("decode-0", turn_two + [1])
    assert p.choose(turn_two + [1], 16, set()) is None


def test_nothing_goes_local_before_the_run_measured_the_link_and_the_rates():
    p = policy()
    p.remember("decode-0", TURN_ONE)
    assert not p.allows(64, 0, 16) and p.choose(TURN_ONE + [1] * 64, 16, set()) is None


def move_s(new_tokens: int, link_bytes_per_s: float = 1e9) -> float:
    return (SIZES.slot_bytes + (-(-new_tokens // 16) + 1) * SIZES.page_bytes) / link_bytes_per_s


def test_local_wins_when_decode_computes_the_new_tokens_before_the_remote_path_would_deliver_them():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=1_000, tpot_s=1.0)  # a generous latency budget
    p.measured_locally(500, 1.0)  # decode computes at half prefill's rate
    # local (N / 500) <= remote (N / 1,000 + move): N <= 1,000 * move_s, about 106 tokens
    assert p.allows(100, 0, 16) and not p.allows(120, 0, 16)
    assert 100 / 500 <= 100 / 1_000 + move_s(100) and 120 / 500 > 120 / 1_000 + move_s(120)
    p.remember("decode-0", TURN_ONE)
    assert p.choose(TURN_ONE + [1] * 100, 16, set()) == ("decode-0", 100)
    assert p.choose(TURN_ONE + [1] * 120, 16, set()) is None


def test_where_decode_computes_as_fast_as_prefill_only_the_latency_budget_bounds_it():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=10_000, tpot_s=0.01)  # budget: 0.5 * 10 ms * 16 = 80 ms
    p.measured_locally(10_000, 1.0)
    assert p.allows(800, 0, 16) and not p.allows(801, 0, 16)  # 800 tokens in 80 ms
    assert p.allows(400, 400, 16) and not p.allows(400, 401, 16)  # what is queued there counts
    assert p.allows(1_600, 0, 32)  # a longer reply spreads the delay over more steps


def test_prefills_model_rate_stands_in_for_decodes_until_a_local_prefill_completed():
    p = policy()
    measured(p, link_gbps=1.0, tokens_per_s=1_000, tpot_s=1.0)
    assert not p.allows(64, 0, 16)  # no rate for decode at all: disaggregated
    measured(p, link_gbps=1.0, tokens_per_s=1_000, tpot_s=1.0, model_tokens_per_s=8_000)
    rates = p.prefill_tokens_per_s
    assert rates["local"].value is None and rates["model"].value == 8_000
    # Prefill waits and batches at 1,000 tokens/s; its model computes at 8,000: four turns queued at
    # once on one decode worker all go local, (N + Q) / 8,000 <= N / 1,000 + move.
    p.remember("decode-0", TURN_ONE)
    for queued in (0, 400, 800, 1_200):
        assert p.allows(400, queued, 16)
    p.measured_locally(500, 1.0)  # decode turned out slow: its own rate replaces the stand-in
    assert not p.allows(400, 0, 16)


def test_queued_local_work_and_load_count():
    p = policy(max_tokens=100)
    p.remember("decode-0", TURN_ONE)
    prompt = TURN_ONE + [1] * 60
    p.queued_tokens["decode-0"] = 50  # another local prefill still computing there
    assert p.choose(prompt, 16, set()) is None
    p.queued_tokens["decode-0"] = 0
    p.router.in_flight["decode-0"] = AFFINITY_SLACK + 1  # far busier than decode-1
    assert p.choose(prompt, 16, set()) is None


def test_a_bound_below_one_token_is_refused():
    with pytest.raises(ValueError, match="--local-prefill-max-tokens must be at least 1"):
        ConditionalOptions(max_tokens=0)
