"""Multi-turn conversations: the seeded plan (turn counts, message lengths, the context cut) and
their serving turn by turn through `Server.serve` (each turn's prompt carries the last one's reply,
a conversation's turns never overlap, conversations interleave, a failed turn ends its conversation)."""

import asyncio
import math
from types import SimpleNamespace

import pytest

from distpool.memory.sizing import PoolArgs
from distpool.serving.job.main import exit_status
from distpool.serving.outcome import Outcome
from distpool.serving.path.driver import ServeOptions, Server
from distpool.serving.summary.parity import Parity
from distpool.serving.summary.report import summarize
from distpool.serving.summary.report_text import format_summary
from distpool.serving.workloads.conversation import DEFAULT_TURNS, TurnFeed, generate_conversations
from transfer import TransferOptions

NEW_TOKENS = 16
VOCAB = 1000


def make_plan(requests: int = 16, *, seed: int = 0, **options):
    options.setdefault("vocab_size", VOCAB)
    options.setdefault("context_len", 1 << 20)  # nothing cut unless a test asks for it
    return generate_conversations(requests, max_new_tokens=NEW_TOKENS, seed=seed, **options)


# ---- the plan -------------------------------------------------------------------------------------
def test_conversations_are_reproducible_by_seed_with_short_ids():
    plan = make_plan(24, seed=3)
    assert plan == make_plan(24, seed=3) and plan != make_plan(24, seed=4)
    assert [c.conversation_id for c in plan.conversations] == ["conv-00000", "conv-00001", "conv-00002"]
    assert plan.conversations[1].turn_id(7) == "conv-00001-t007"
    assert plan.turns == DEFAULT_TURNS and plan.turns_planned == plan.turns_asked == 24


@pytest.mark.parametrize("requests, turns, expected", [(16, 8, [8, 8]), (10, 8, [8, 2]), (5, 1, [1] * 5)])
def test_requests_count_turns_and_the_last_conversation_takes_the_remainder(requests, turns, expected):
    plan = make_plan(requests, turns=turns)
    assert len(plan.conversations) == math.ceil(requests / turns)
    assert [len(c.messages) for c in plan.conversations] == expected
    assert sum(expected) == requests


def test_user_messages_are_64_to_1024_tokens_within_the_vocab():
    plan = make_plan(400, turns=4, seed=1)
    sizes = [len(m) for c in plan.conversations for m in c.messages]
    assert 64 <= min(sizes) < 150 and 950 < max(sizes) <= 1024
    assert all(0 <= t < VOCAB for c in plan.conversations for m in c.messages for t in m)
    default_vocab = make_plan(8, vocab_size=0)
    assert max(t for c in default_vocab.conversations for m in c.messages for t in m) > VOCAB


@pytest.mark.parametrize("seed", range(5))
def test_a_conversation_ends_before_the_turn_that_would_not_fit_the_context(seed):
    context_len = 2000
    cut = make_plan(64, turns=8, seed=seed, context_len=context_len)
    assert cut.turns_planned < cut.turns_asked == 64 and len(cut.conversations) == 8  # not handed on
    for c in cut.conversations:  # every planned turn fits, each reply counted at full length
        assert sum(map(len, c.messages)) + NEW_TOKENS * len(c.messages) <= context_len
    # the first conversation draws the same messages as without a limit, up to the cut
    first, whole = cut.conversations[0], make_plan(64, turns=8, seed=seed).conversations[0]
    kept = len(first.messages)
    assert 1 <= kept < 8 and first.messages == whole.messages[:kept]
    assert sum(map(len, whole.messages[: kept + 1])) + NEW_TOKENS * (kept + 1) > context_len


def test_the_first_message_clips_to_the_context_and_never_another_turn_is_added():
    plan = make_plan(16, turns=8, context_len=100)
    assert [len(c.messages) for c in plan.conversations] == [1, 1]  # 84 tokens, then nothing fits
    assert all(len(c.messages[0]) <= 100 - NEW_TOKENS for c in plan.conversations)
    assert "2 conversations of up to 8 turns (2 turns, 14 cut by --context-len 100)" == plan.describe()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"turns": 0}, "--turns must be >= 1 (turns per conversation); got 0"),
        ({"context_len": NEW_TOKENS}, "--context-len 16 leaves no room"),
        ({"vocab_size": -1}, "vocab_size >= 0"),
    ],
)
def test_bad_input_is_refused_with_the_fix(options, message):
    with pytest.raises(ValueError) as info:
        make_plan(**options)
    assert message in str(info.value)


def test_no_turns_at_all_is_refused():
    with pytest.raises(ValueError, match="requests and max_new_tokens must be >= 1"):
        make_plan(0)


# ---- serving turn by turn -------------------------------------------------------------------------
class _NoResults:
    """A decode worker's result long-poll that never has anything (the scripted server needs none)."""

    class next_finished:
        @staticmethod
        async def remote(wait_s):
            await asyncio.sleep(0.01)
            return {}


class ScriptedServer(Server):
    """The real `serve` loop with each request's PD path replaced by a short sleep: replies are a
    function of the prompt, `fail` lists request ids that fail."""

    def __init__(self, *, fail: frozenset[str] = frozenset(), queue_bound: int = 64) -> None:
        # It serves every turn itself: no decode worker to prefill locally on.
        worker = SimpleNamespace(pool_args=PoolArgs(), transfer=TransferOptions(), local_prefill=False)
        deployment = SimpleNamespace(
            prefill={"prefill-0": None},
            decode={"decode-0": _NoResults()},
            spec=SimpleNamespace(worker=worker, colocated=False),
        )
        super().__init__(deployment, ServeOptions(queue_bound=queue_bound, progress=False))
        self.fail = fail
        self.started: list[str] = []
        self.running: set[str] = set()  # conversations with a turn in service
        self.overlaps: list[str] = []  # a turn started while its conversation had another in service
        self.most_conversations_at_once = 0

    async def _serve_one(self, req):
        conversation = req.request_id.rsplit("-t", 1)[0]
        if conversation in self.running:
            self.overlaps.append(req.request_id)
        self.running.add(conversation)
        self.started.append(req.request_id)
        self.most_conversations_at_once = max(self.most_conversations_at_once, len(self.running))
        await asyncio.sleep(0.002)
        self.running.discard(conversation)
        if req.request_id in self.fail:
            return Outcome(request_id=req.request_id, error="TransferError: injected", attempts=1)
        reply = [(len(req.prompt) * 7 + i) % VOCAB for i in range(req.max_new_tokens)]
        return Outcome(request_id=req.request_id, tokens=reply, attempts=1)


def serve_plan(plan, **server_options):
    server = ScriptedServer(**server_options)
    feed = TurnFeed(plan)
    outcomes = asyncio.run(server.serve(feed.first_turns(), feed.next_turn))
    return outcomes, feed, server


def test_each_turn_is_the_last_prompt_plus_its_reply_plus_a_new_message():
    plan = make_plan(12, turns=4, seed=2, message_len=(3, 9))
    outcomes, feed, server = serve_plan(plan)
    replies = {o.request_id: o.tokens for o in outcomes}
    prompts = {r.request_id: r.prompt for r in feed.served}
    assert len(outcomes) == len(feed.served) == 12 and all(o.tokens is not None for o in outcomes)
    for c in plan.conversations:
        assert prompts[c.turn_id(0)] == list(c.messages[0])
        for turn in range(1, len(c.messages)):
            before = c.turn_id(turn - 1)
            assert prompts[c.turn_id(turn)] == prompts[before] + replies[before] + list(c.messages[turn])
    assert server.overlaps == []  # a conversation's turns never run at once
    assert server.most_conversations_at_once == 3  # but conversations do
    summary = feed.summary()
    assert (summary["conversations"], summary["conversations_completed"]) == (3, 3)
    assert (summary["turns_completed"], summary["turns_skipped"], summary["turns_cut_by_context"]) == (
        12,
        0,
        0,
    )


def test_conversations_interleave_first_turns_first():
    plan = make_plan(9, turns=3, message_len=(2, 4))
    _, _, server = serve_plan(plan, queue_bound=1)  # one at a time: the queue order shows
    assert server.started == [f"conv-{c:05d}-t{t:03d}" for t in range(3) for c in range(3)]


def test_a_failed_turn_ends_its_conversation_and_the_rest_is_reported_skipped():
    plan = make_plan(12, turns=4, message_len=(2, 4))
    outcomes, feed, server = serve_plan(plan, fail=frozenset({"conv-00001-t001"}))
    served = [o.request_id for o in outcomes]
    assert "conv-00001-t001" in served and "conv-00001-t002" not in served and "conv-00001-t003" not in served
    assert len(served) == 10 and feed.failed_at == {"conv-00001": 1}
    summary = feed.summary()
    assert (summary["conversations_completed"], summary["turns_completed"]) == (2, 9)
    assert (summary["turns_served"], summary["turns_skipped"]) == (10, 2)
    report = summarize(outcomes, retried=0, worker_stats=[], parity=Parity(), wall_s=1.0, multi_turn=summary)
    assert (report["requests"], report["failed"]) == (10, 1)
    assert exit_status(report) == 1
    text = format_summary(report)
    assert "turns skipped after a failure  2" in text and "conversations completed / all  2 / 3" in text
    assert "error: TransferError: injected" in text


def test_a_skipped_turn_alone_fails_the_run():
    report = summarize([], retried=0, worker_stats=[], parity=Parity(), wall_s=1.0, multi_turn=None)
    assert exit_status(report) == 0 and "multi_turn" not in report
    report["multi_turn"] = {"turns_skipped": 1}
    assert exit_status(report) == 1


def test_latest_turns_come_first_for_the_parity_sample():
    plan = make_plan(6, turns=3, message_len=(2, 4))
    _, feed, _ = serve_plan(plan)
    assert [r.request_id[-4:] for r in feed.latest_turns_first()] == ["t002"] * 2 + ["t001"] * 2 + [
        "t000"
    ] * 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workload", "multi-turn", "--turns", "0"], "--turns must be >= 1"),
        (["--workload", "short", "--turns", "4"], "--turns applies to --workload multi-turn only"),
    ],
)
def test_the_cli_refuses_bad_turns_with_exit_status_2(flags, message, capsys):
    from distpool.cli import main

    assert main(["run", "--memory-gib", "0.0625", *flags]) == 2
    assert message in capsys.readouterr().err
