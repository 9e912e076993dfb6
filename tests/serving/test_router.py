"""Routing decisions, workloads and the summary: the pure parts of PD serving."""

import json

import pytest

from distpool.serving import workload
from distpool.serving.outcome import Outcome
from distpool.serving.report import percentile, summarize
from distpool.serving.router import NoWorkerAlive, Router


def test_prefill_goes_to_least_loaded_live_worker():
    router = Router(["p0", "p1", "p2"], ["d0"])
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
    router = Router(["p0"], ["d0", "d1", "d2"])
    router.begin("d1")
    assert router.decode_candidates() == ["d0", "d2", "d1"]
    assert router.decode_candidates(avoid={"d0"}) == ["d2", "d1", "d0"]
    router.mark_dead("d2")
    assert router.decode_candidates() == ["d0", "d1"]


def test_all_dead_is_a_typed_error():
    router = Router(["p0"], ["d0"])
    router.mark_dead("d0")
    with pytest.raises(NoWorkerAlive, match="decode"):
        router.decode_candidates()
    with pytest.raises(ValueError):
        Router([], ["d0"])


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
        Outcome(request_id="b", error="TransferError: boom"),
    ]
    worker = dict(pages_used=0, slots_used=1)  # still held after the drain: a leaked slot
    report = summarize(outcomes, retried=2, worker_stats=[worker], parity=(1, 0), wall_s=1.0)
    assert (report["requests"], report["completed"], report["failed"], report["retried"]) == (2, 1, 1, 2)
    assert report["transfer_gbps"] == pytest.approx(1.0)
    assert report["tpot_ms_p50"] == pytest.approx(10.0)
    assert report["leaked_slots"] == 1 and report["errors"] == ["TransferError: boom"]


def test_typed_errors_cross_process_boundaries_as_themselves():
    """Ray pickles a worker's exception; the driver catches DoesNotFit by type (regression: it
    arrived as UnserializableException and was told apart by its message text)."""
    import pickle

    from distpool.memory.allocator import NeedsCompaction
    from transfer import TransferError

    err = pickle.loads(pickle.dumps(NeedsCompaction("r1", "fragmented")))
    assert type(err) is NeedsCompaction and (err.request_id, err.reason) == ("r1", "fragmented")
    err = pickle.loads(pickle.dumps(TransferError("r2", "peer died", channel_broken=True)))
    assert (err.request_id, err.reason, err.channel_broken) == ("r2", "peer died", True)


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
