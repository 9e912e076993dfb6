"""Routing decisions, workloads and the summary: the pure parts of PD serving."""

import json

import pytest

from distpool.memory.prefix import CacheNews, chained_block_keys
from distpool.serving.outcome import Outcome
from distpool.serving.routing.router import AFFINITY_SLACK, NoWorkerAlive, Router, RouterArgInvalid
from distpool.serving.summary.parity import Parity
from distpool.serving.summary.report import percentile, summarize
from distpool.serving.summary.report_text import format_summary
from distpool.serving.summary.worker_reading import WorkerReading
from distpool.serving.workloads import workload
from tests.factories import make_decode_stats
from transfer import FailureKind


def pages(tokens: list[int], router: Router) -> CacheNews:
    """A decode worker's report that it cached every full block of `tokens`."""
    return CacheNews(cached_pages=tuple(chained_block_keys(tokens, router.page_size)))


def test_prefill_goes_to_least_loaded_live_worker():
    router = Router(["p0", "p1", "p2"], ["d0"], page_size=16)
    router.begin("p0")
    router.begin("p0")
    router.begin("p1")
    assert router.pick_prefill() == "p2"
    router.mark_dead("p2")
    assert router.pick_prefill() == "p1"
    router.end("p0")
    router.end("p0")
    assert router.pick_prefill() == "p0"


def test_decode_candidates_put_avoided_workers_last_and_skip_dead():
    router = Router(["p0"], ["d0", "d1", "d2"], page_size=16)
    router.begin("d1")
    assert router.decode_candidates() == ["d0", "d2", "d1"]
    assert router.decode_candidates(avoid={"d0"}) == ["d2", "d1", "d0"]
    router.mark_dead("d2")
    assert router.decode_candidates() == ["d0", "d1"]


def test_all_dead_is_a_typed_error():
    router = Router(["p0"], ["d0"], page_size=16)
    router.mark_dead("d0")
    with pytest.raises(NoWorkerAlive) as caught:
        router.decode_candidates()
    assert caught.value.role == "decode"
    with pytest.raises(RouterArgInvalid) as caught:
        Router(["p0"], [], page_size=16)
    assert (caught.value.field, caught.value.value) == ("decode_names", [])


def test_a_colocated_router_has_no_prefill_worker_and_routes_decode_by_load():
    router = Router([], ["d0", "d1"], page_size=4)
    router.begin("d0")
    assert router.decode_candidates() == ["d1", "d0"]


def test_next_turn_of_a_conversation_goes_to_the_worker_that_served_it():
    router = Router(["p0"], ["d0", "d1", "d2"], page_size=4)
    turn1 = list(range(10))  # prompt + generated tokens but the last: two full blocks, 2 tokens left over
    router.learned("d2", pages(turn1, router))
    router.begin("d2")  # busier than the others, but well within the slack
    turn2 = turn1 + [50, 51, 52, 53, 54]
    assert router.matched_blocks("d2", turn2) == 2
    assert router.matched_blocks("d0", turn2) == 0
    assert router.decode_candidates(tokens=turn2) == ["d2", "d0", "d1"]
    # a different conversation, or no tokens at all, keeps plain load order
    assert router.decode_candidates(tokens=[9, 9, 9, 9, 9]) == ["d0", "d1", "d2"]
    assert router.decode_candidates() == ["d0", "d1", "d2"]


def test_longest_match_wins_and_ties_go_to_the_lower_load():
    router = Router(["p0"], ["d0", "d1", "d2"], page_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    router.learned("d0", pages(prompt[:2], router))
    router.learned("d2", pages(prompt[:6], router))
    # diverges in block 1: its block 2 is another prefix
    router.learned("d1", pages([1, 2, 3, 9, 5, 6], router))
    assert [router.matched_blocks(n, prompt) for n in ("d0", "d1", "d2")] == [1, 1, 3]
    assert router.decode_candidates(tokens=prompt) == ["d2", "d0", "d1"]
    assert router.decode_candidates(tokens=prompt[:3]) == ["d0", "d1", "d2"]  # all tie at 1 block: listed
    router.begin("d0")
    assert router.decode_candidates(tokens=prompt[:3]) == ["d1", "d2", "d0"]  # tie: lower load first
    assert router.decode_candidates(tokens=prompt[:4]) == ["d2", "d1", "d0"]  # d2 alone holds 2 blocks


def test_a_request_keys_its_prompt_once_and_routing_reads_the_keys(monkeypatch):
    """A request's routing decisions (every attempt, every pass waiting for room) match decode
    caches by its prompt's block keys, hashed once per request."""
    router = Router(["p0"], ["d0", "d1", "d2"], page_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    router.learned("d1", pages(prompt[:6], router))
    router.learned("d2", pages(prompt[:2], router))
    hashed = []

    def counted(tokens, block):
        hashed.append(block)
        return chained_block_keys(tokens, block)

    monkeypatch.setattr(workload, "chained_block_keys", counted)
    req = workload.Request("r", prompt)
    for _ in range(3):
        assert router.decode_candidates(keys=req.block_keys(2)) == ["d1", "d0", "d2"]
    assert router.decode_candidates(tokens=prompt) == ["d1", "d0", "d2"]  # the same order from tokens
    assert hashed == [2]
    assert req == workload.Request("r", prompt)  # the keys it keeps are no part of what it is


def test_an_overloaded_affinity_worker_falls_back_to_load_order():
    router = Router(["p0"], ["d0", "d1", "d2"], page_size=2)
    prompt = [1, 2, 3, 4]
    router.learned("d1", pages(prompt, router))
    router.begin("d0")
    for _ in range(AFFINITY_SLACK):
        router.begin("d1")
    assert router.decode_candidates(tokens=prompt) == ["d1", "d2", "d0"]  # exactly the slack: still first
    router.begin("d1")
    assert router.decode_candidates(tokens=prompt) == ["d2", "d0", "d1"]
    router.end("d1")
    assert router.decode_candidates(tokens=prompt) == ["d1", "d2", "d0"]


def test_an_avoided_worker_goes_last_even_with_the_best_match():
    router = Router(["p0"], ["d0", "d1", "d2"], page_size=2)
    prompt = [1, 2, 3, 4]
    router.learned("d0", pages(prompt, router))
    router.learned("d2", pages(prompt[:2], router))
    router.begin("d1")
    assert router.decode_candidates(avoid={"d0"}, tokens=prompt) == ["d2", "d1", "d0"]
    assert router.decode_candidates(avoid={"d0", "d2"}, tokens=prompt) == ["d1", "d0", "d2"]
    assert router.decode_candidates(avoid={"d0", "d1", "d2"}, tokens=prompt) == ["d0", "d2", "d1"]


def test_mark_dead_forgets_the_cached_view():
    router = Router(["p0"], ["d0", "d1"], page_size=2)
    prompt = [1, 2, 3, 4]
    router.learned("d1", pages(prompt, router))
    assert router.decode_candidates(tokens=prompt) == ["d1", "d0"]
    router.mark_dead("d1")
    assert router.decode_candidates(tokens=prompt) == ["d0"]
    router.learned("d1", pages(prompt, router))  # a late report from the dead worker is stale
    router.revive("d1")
    assert router.matched_blocks("d1", prompt) == 0
    assert router.decode_candidates(tokens=prompt) == ["d0", "d1"]
    with pytest.raises(RouterArgInvalid) as caught:
        router.learned("p0", pages(prompt, router))
    assert (caught.value.field, caught.value.value) == ("decode_name", "p0")


def test_the_view_follows_what_decode_evicted():
    router = Router(["p0"], ["d0", "d1"], page_size=2)
    a, b = [1, 1, 2, 2, 3, 3], [1, 1, 5, 5]
    router.learned("d1", pages(a, router))
    router.learned("d1", pages(b, router))
    assert [router.matched_blocks("d1", t) for t in (a, b)] == [3, 2]
    a_keys = chained_block_keys(a, 2)
    router.learned("d1", CacheNews(evicted_pages=tuple(a_keys[1:])))  # a's leaves went, the root stays
    assert [router.matched_blocks("d1", t) for t in (a, b)] == [1, 2]
    assert router.views["d1"].keys().pages == {a_keys[0], chained_block_keys(b, 2)[1]}
    assert router.decode_candidates(tokens=a) == ["d1", "d0"]
    router.learned("d1", CacheNews(evicted_pages=(a_keys[0],)))
    assert router.decode_candidates(tokens=a) == ["d0", "d1"]  # no affinity left: load order


def test_page_size_must_be_positive():
    with pytest.raises(RouterArgInvalid) as caught:
        Router(["p0"], ["d0"], page_size=0)
    assert (caught.value.field, caught.value.value) == ("page_size", 0)
    assert isinstance(caught.value, ValueError)


def test_generated_workload_is_seeded_and_in_range():
    a = workload.generate(20, vocab_size=50, min_prompt=3, max_prompt=9, max_new_tokens=4, seed=7)
    b = workload.generate(20, vocab_size=50, min_prompt=3, max_prompt=9, max_new_tokens=4, seed=7)
    assert a == b
    assert all(3 <= len(r.prompt) <= 9 and max(r.prompt) < 50 for r in a)
    assert len({len(r.prompt) for r in a}) > 1
    with pytest.raises(ValueError):
        workload.generate(0, vocab_size=50, min_prompt=3, max_prompt=9, max_new_tokens=4, seed=7)


def test_jsonl_prompts_and_their_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(
        json.dumps({"prompt_ids": [1, 2]}) + "\n\n" + json.dumps({"prompt": "hi", "id": "x"}) + "\n"
    )
    reqs = workload.load_jsonl(good, vocab_size=100, max_new_tokens=3)
    assert [(r.request_id, r.prompt) for r in reqs] == [("req-00001", [1, 2]), ("x", [104 % 100, 105 % 100])]
    for text, message in [
        ("{not json", "invalid JSON"),
        ("[1]", "JSON object"),
        ('{"prompt_ids": [1, 500]}', "prompt_ids"),
        ('{"other": 1}', "needs"),
        ('{"prompt_ids": []}', "non-empty"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(ValueError, match=message):
            workload.load_jsonl(bad, vocab_size=100, max_new_tokens=3)
    with pytest.raises(ValueError, match="cannot read"):
        workload.load_jsonl(tmp_path / "missing.jsonl", vocab_size=100, max_new_tokens=3)


def test_percentile_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0


def test_summary_counts_and_rates():
    outcomes = [
        Outcome(
            request_id="a",
            tokens=[1, 2, 3],
            queue_s=0.01,
            decode_s=0.02,
            transfer_bytes=1000,
            transfer_s=1e-6,
        ),
        Outcome(
            request_id="b",
            error="TransferError: boom",
            failure=FailureKind.PEER_LOST,
            retried_after=[FailureKind.CORRUPT, FailureKind.ABORTED, FailureKind.CORRUPT],
        ),
        Outcome(request_id="c", error="not admitted within 60 s", failure=FailureKind.NOT_ADMITTED),
        Outcome(request_id="d", error="TransferError: bang", failure=FailureKind.PEER_LOST),
    ]
    worker = WorkerReading(
        name="decode-0", stats=make_decode_stats(slots_used=1)
    )  # held after the drain: leaked
    report = summarize(outcomes, retried=2, worker_stats=[worker], parity=Parity(checked=1), wall_s=1.0)
    assert (report["requests"], report["completed"], report["failed"], report["retried"]) == (4, 1, 3, 2)
    assert report["failures_by_reason"] == {"peer_lost": 2, "not_admitted": 1}  # most first
    rows = [line.split(None, 1) for line in format_summary(report).splitlines()]
    assert ["failed", "3 (peer_lost 2, not_admitted 1)"] in rows
    assert report["retries_by_reason"] == {"corrupt": 2, "aborted": 1}  # retried attempts, most first
    assert ["retried", "2 (corrupt 2, aborted 1)"] in rows
    assert report["transfer_gbps"] == pytest.approx(1.0)
    assert report["tpot_ms_p50"] == pytest.approx(10.0)
    assert report["leaked_slots"] == 1
    assert report["errors"] == ["TransferError: bang", "TransferError: boom", "not admitted within 60 s"]


def test_typed_errors_cross_process_boundaries_as_themselves():
    """Ray pickles a worker's exception; the driver catches DoesNotFit by type (regression: it
    arrived as UnserializableException and was told apart by its message text)."""
    import pickle

    from distpool.memory.pool import NeedsCompaction
    from transfer import ChannelError, TransferError

    err = pickle.loads(pickle.dumps(NeedsCompaction("r1", "fragmented")))
    assert type(err) is NeedsCompaction and (err.request_id, err.reason) == ("r1", "fragmented")
    err = pickle.loads(
        pickle.dumps(TransferError("r2", FailureKind.PEER_LOST, "peer died", channel_broken=True))
    )
    assert (err.request_id, err.kind, err.reason, err.channel_broken) == (
        "r2",
        FailureKind.PEER_LOST,
        "peer died",
        True,
    )
    err = pickle.loads(pickle.dumps(ChannelError("recv: timed out", kind=FailureKind.TIMEOUT)))
    assert type(err) is ChannelError and err.kind is FailureKind.TIMEOUT


def test_errors_in_the_summary_are_one_line_without_ray_colour_codes():
    from distpool.serving.outcome import one_line

    class RemoteError(Exception):  # the shape of Ray's RayTaskError: the cause, and a long text
        def __init__(self, cause: Exception) -> None:
            super().__init__(
                "\x1b[36mray::DecodeWorker.reserve()\x1b[39m (pid=1)\n  File 'x', line 1\nValueError"
            )
            self.cause = cause

    assert one_line(RemoteError(ValueError("bad id\nsecond line"))) == "ValueError: bad id"
    assert one_line(RuntimeError("\x1b[31mred\x1b[0m")) == "RuntimeError: red"
