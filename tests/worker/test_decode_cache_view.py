"""The driver's view of a decode worker's cache equals the worker's own after every result: decode
reports what its prefix cache cached and evicted with the results it hands out (`DecodeEvents.cache`),
and the router applies each report. Conversations that share a system prompt overflow a small pool,
so the cache evicts pages and kept states while they are served; the conditional policy chooses
every local prefill from that view, and no choice is refused for a state the worker no longer keeps.
The worker is built directly (colocated: no Ray, no prefill worker)."""

from __future__ import annotations

import dataclasses
import random
import time

from decode.worker import DecodeWorker
from distpool.model.sampling import SamplingParams
from distpool.serving.routing.conditional import ConditionalOptions, LocalPrefillPolicy, Sizes
from distpool.serving.routing.router import Router
from distpool.worker.messages import (
    DecodeFinished,
    LocalPrefillRefused,
    LocalPrefillStarted,
    Refusal,
    ViewedState,
)
from tests.worker.test_decode_prefix_reuse import PAGE_SIZE, reference_config

NAME = "decode-0"
SYSTEM = list(range(60, 78))  # every conversation's first 18 tokens: four full pages shared
MAX_NEW = 4
TURNS = 4
CONVERSATIONS = 16
# About 150 pages or 16 states: the conversations cache far more than that (pages and states are
# both evicted), and still keep states for the turns that come back soon.
BUDGET = 160 << 10


def conversations(count: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, the new tokens of each turn (its first turn starts with SYSTEM)."""
    rng = random.Random(seed)
    return [
        [([*SYSTEM] if turn == 0 else []) + [rng.randrange(1, 60) for _ in range(rng.randrange(3, 12))]
         for turn in range(turns)]
        for _ in range(count)
    ]  # fmt: skip


def served(d: DecodeWorker, router: Router, rid: str, timeout_s: float = 30.0) -> DecodeFinished:
    """Wait for `rid`'s result the way the driver does: every report applied to the router's view
    as it comes, results or not; after each, the view equals the worker's cache."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = d.next_events(0.5)
        router.learned(NAME, events.cache)
        assert router.views[NAME].keys() == d.cache_keys()
        if rid in events.finished:
            result = events.finished[rid]
            assert isinstance(result, DecodeFinished), result
            return result
    raise AssertionError(f"{rid} did not finish within {timeout_s} s")


def serve_conversations(d: DecodeWorker, router: Router, count: int, seed: int) -> tuple[int, int, int]:
    """Serve `count` conversations of TURNS turns, one request at a time, in a seeded interleaving
    (one that comes back soon finds its state, one that comes back late finds it evicted); each
    turn is prefilled from the state the driver's view says the worker keeps, else from nothing.
    Returns (turns prefilled from a state, local prefills refused, of which for no state)."""
    policy = LocalPrefillPolicy(router, Sizes(1, 1, PAGE_SIZE), ConditionalOptions(max_tokens=10_000))
    plan = conversations(count, TURNS, seed)
    queue = [c for c in range(count) for _ in range(TURNS)]
    random.Random(seed).shuffle(queue)
    history: dict[int, list[int]] = {}  # conversation -> every token so far
    turns = dict.fromkeys(range(count), 0)  # conversation -> its turns served
    local = refused = stale = 0
    for c in queue:
        turn, turns[c] = turns[c], turns[c] + 1
        prompt = [*history.get(c, []), *plan[c][turn]]
        rid = f"c{c}t{turn}"
        params = SamplingParams(max_tokens=MAX_NEW)
        chosen = policy.choose(prompt, MAX_NEW, set())
        answer = None
        if chosen is not None:
            viewed = ViewedState(held_tokens=chosen[1], report=router.views[NAME].report)
            answer = d.local_prefill(rid, prompt, params, viewed=viewed)
        if isinstance(answer, LocalPrefillRefused):
            refused += 1
            stale += answer.kind is Refusal.NO_STATE
        if isinstance(answer, LocalPrefillStarted):
            local += 1
            assert answer.held_tokens == chosen[1]
        else:  # no state in the view, or refused
            assert isinstance(d.local_prefill(rid, prompt, params, fresh=True), LocalPrefillStarted)
        result = served(d, router, rid)
        history[c] = [*prompt, *result.tokens]
    return local, refused, stale


def test_the_drivers_view_equals_decodes_cache_after_every_result_under_eviction():
    config = dataclasses.replace(reference_config(budget_bytes=BUDGET), local_prefill_chunk=8)
    d = DecodeWorker(name=NAME, config=config)
    try:
        cache = d.pool.prefix_cache
        assert cache is not None and cache.final_states is not None
        router = Router([], [NAME], page_size=PAGE_SIZE)
        local, refused, stale = serve_conversations(d, router, CONVERSATIONS, seed=5)
        d.pool.check_invariants()
        assert cache.evicted[0] > 0 and cache.final_states.evicted[1] > 0, cache.evicted  # it did evict
        assert local > 0  # some later turns found their state, through the view alone
        assert stale == 0, f"{stale} of {refused} refusals came from a stale view"
        keys = d.cache_keys()
        assert keys.pages and keys.states
        d.drop_prefix_cache()  # the end of a run is reported too: an empty cache, an empty view
        router.learned(NAME, d.next_events(0.1).cache)
        assert router.views[NAME].keys() == d.cache_keys() and not d.cache_keys().pages
    finally:
        d.shutdown()


def test_a_refusal_says_whether_the_driver_had_heard_that_the_state_was_gone():
    config = dataclasses.replace(reference_config(), local_prefill_chunk=8)
    d = DecodeWorker(name=NAME, config=config)
    router = Router([], [NAME], page_size=PAGE_SIZE)
    try:
        first = [*SYSTEM, 7, 8, 9]
        assert isinstance(
            d.local_prefill("t1", first, SamplingParams(max_tokens=MAX_NEW), fresh=True), LocalPrefillStarted
        )
        held = [*first, *served(d, router, "t1").tokens[:-1]]
        assert router.views[NAME].longest_state([*held, 1]) == len(held)
        viewed = ViewedState(held_tokens=len(held), report=router.views[NAME].report)
        with d.lock:
            assert d.pool.prefix_cache.final_states.evict(1)[1] == 1  # gone, not reported yet
        second = SamplingParams(max_tokens=MAX_NEW)
        assert d.local_prefill("t2", [*held, 1], second, viewed=viewed).kind is Refusal.NEWS_IN_FLIGHT
        router.learned(NAME, d.next_events(0.1).cache)  # the report comes at once, with no result
        assert (
            router.views[NAME].keys() == d.cache_keys()
            and router.views[NAME].longest_state([*held, 1]) is None
        )
        # A driver that chose from the view it had before that report, though it applied it: stale.
        late = ViewedState(held_tokens=len(held), report=router.views[NAME].report)
        assert d.local_prefill("t3", [*held, 1], second, viewed=late).kind is Refusal.NO_STATE
    finally:
        d.shutdown()
