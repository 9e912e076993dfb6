"""Multi-turn conversations (`--workload multi-turn`): each turn's prompt is the previous turn's
prompt, the reply generated for it and a new user message.

    turn 0:  m0
    turn 1:  m0 + reply0 + m1
    turn 2:  m0 + reply0 + m1 + reply1 + m2

Planned up front, realized while served:
- `generate_conversations` draws every conversation's user messages (seeded) and cuts each
  conversation before the first turn that would not fit `--context-len` with its new tokens,
  counting every reply at its full `max_new_tokens` (no reply is longer), so the plan never depends
  on the tokens served.
- `TurnFeed` hands the turns to `Server.serve(feed.first_turns(), feed.next_turn)`: every
  conversation's first turn at the start, turn k+1 only once turn k completed (its prompt needs turn
  k's reply). A failed turn ends its conversation; the turns it never reached are counted as skipped.

`--requests` counts turns: ceil(requests / turns) conversations of `turns` turns each, the last one
holding the remainder. Turns cut by the context are not given to another conversation, so at most
`--requests` turns are served.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, replace

from distpool.memory.sizing import PoolArgs
from distpool.model.sampling import SamplingParams
from distpool.serving.outcome import Outcome
from distpool.serving.workloads.workload import DEFAULT_VOCAB_SIZE, Request, check_workload_size, prompt_room

DEFAULT_TURNS = 8
USER_MESSAGE = (64, 1024)  # tokens of each turn's new user message, uniform; the first is clipped to fit


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    messages: tuple[tuple[int, ...], ...]  # each planned turn's user message, in turn order
    turns_asked: int  # before the context cut: len(messages) <= turns_asked
    params: SamplingParams  # every turn's (its seed drawn per turn, by the server)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_tokens

    def turn_id(self, turn: int) -> str:
        return f"{self.conversation_id}-t{turn:03d}"


@dataclass(frozen=True)
class MultiTurn:
    """A multi-turn workload: its conversations, planned; `TurnFeed` realizes their prompts."""

    conversations: tuple[Conversation, ...]
    turns: int  # --turns: turns asked per conversation
    context_len: int

    @property
    def turns_asked(self) -> int:
        return sum(c.turns_asked for c in self.conversations)

    @property
    def turns_planned(self) -> int:
        return sum(len(c.messages) for c in self.conversations)

    def describe(self) -> str:
        cut = self.turns_asked - self.turns_planned
        fit = f", {cut} cut by --context-len {self.context_len}" if cut else ""
        conversations = f"{len(self.conversations)} conversations of up to {self.turns} turns"
        return f"{conversations} ({self.turns_planned} turns{fit})"


def generate_conversations(
    num_requests: int,
    *,
    turns: int = DEFAULT_TURNS,
    vocab_size: int,
    max_new_tokens: int,
    seed: int,
    context_len: int = PoolArgs.context_len,
    message_len: tuple[int, int] = USER_MESSAGE,
    sampling: SamplingParams | None = None,
) -> MultiTurn:
    """ceil(num_requests / turns) conversations, `num_requests` turns in all before the context cut.

    User messages are `message_len` tokens (uniform) of ids in [0, vocab_size); the first one is
    clipped to `context_len - max_new_tokens`. The same arguments give the same conversations.
    `vocab_size` 0: DEFAULT_VOCAB_SIZE. `sampling`: every turn's parameters but max_tokens (None:
    greedy)."""
    if turns < 1:
        raise ValueError(f"--turns must be >= 1 (turns per conversation); got {turns}")
    if num_requests < 1 or max_new_tokens < 1 or vocab_size < 0 or not 1 <= message_len[0] <= message_len[1]:
        raise ValueError(
            f"bad workload: requests={num_requests}, max_new_tokens={max_new_tokens}, "
            f"vocab_size={vocab_size}, user messages of {message_len[0]}-{message_len[1]} tokens; "
            "requests and max_new_tokens must be >= 1, vocab_size >= 0 and messages 1 token or longer"
        )
    limit = prompt_room(context_len, max_new_tokens)
    # Turn k's prompt holds k messages and replies (the feed keeps every realized prompt): the mean
    # turn holds about half a conversation's, within the context.
    per_turn = (sum(message_len) / 2 + max_new_tokens) * (min(turns, num_requests) + 1) / 2
    check_workload_size(num_requests, min(per_turn, limit))
    rng = random.Random(seed)
    tokens = range(vocab_size or DEFAULT_VOCAB_SIZE)
    conversations = []
    for c in range(math.ceil(num_requests / turns)):
        asked = min(turns, num_requests - c * turns)
        messages: list[tuple[int, ...]] = []
        prompt_len = 0  # the last planned turn's prompt, every reply counted at max_new_tokens
        for turn in range(asked):
            length = rng.randint(*message_len)
            if turn == 0:
                length = min(length, limit)
            elif prompt_len + max_new_tokens + length > limit:
                break  # this turn would not fit the context: the conversation ends here
            prompt_len += (max_new_tokens if turn else 0) + length
            messages.append(tuple(rng.choices(tokens, k=length)))
        conversations.append(
            Conversation(
                conversation_id=f"conv-{c:05d}",
                messages=tuple(messages),
                turns_asked=asked,
                params=replace(sampling or SamplingParams(), max_tokens=max_new_tokens),
            )
        )
    return MultiTurn(conversations=tuple(conversations), turns=turns, context_len=context_len)


class TurnFeed:
    """One serving of a `MultiTurn`: each conversation's turns in order, each once the one before it
    completed. `served` holds every submitted turn with the prompt it was actually served with."""

    def __init__(self, plan: MultiTurn) -> None:
        self.plan = plan
        self.served: list[Request] = []  # in submission order
        self.failed_at: dict[str, int] = {}  # conversation id -> the turn that failed and ended it
        self._turn_of: dict[str, tuple[Conversation, int]] = {}  # request id -> its conversation, turn
        self._completed: Counter[str] = Counter()  # conversation id -> turns completed

    def first_turns(self) -> list[Request]:
        return [self._submit(c, 0, []) for c in self.plan.conversations]

    def next_turn(self, request: Request, outcome: Outcome) -> Request | None:
        """The turn `outcome` unlocks: none after the last planned turn or after a failed one."""
        conversation, turn = self._turn_of[request.request_id]
        if outcome.tokens is None:
            self.failed_at[conversation.conversation_id] = turn
            return None
        self._completed[conversation.conversation_id] += 1
        if turn + 1 == len(conversation.messages):
            return None
        return self._submit(conversation, turn + 1, request.prompt + list(outcome.tokens))

    def _submit(self, conversation: Conversation, turn: int, history: list[int]) -> Request:
        prompt = history + list(conversation.messages[turn])
        request = Request(request_id=conversation.turn_id(turn), prompt=prompt, params=conversation.params)
        # The plan counted every reply at max_new_tokens, and no reply is longer.
        if len(prompt) + request.max_new_tokens > self.plan.context_len:
            raise ValueError(
                f"{request.request_id}: {len(prompt)} prompt tokens and {request.max_new_tokens} new ones "
                f"pass the plan's context of {self.plan.context_len}"
            )
        self._turn_of[request.request_id] = (conversation, turn)
        self.served.append(request)
        return request

    def latest_turns_first(self) -> list[Request]:
        """The served turns, later turns first: a parity sample then covers the prompts that carry
        earlier replies."""
        return sorted(self.served, key=lambda r: -self._turn_of[r.request_id][1])

    def summary(self) -> dict:
        """Conversations and turns, for the run's summary (after serving)."""
        conversations = self.plan.conversations
        planned = self.plan.turns_planned
        return {
            "conversations": len(conversations),
            "conversations_completed": sum(
                self._completed[c.conversation_id] == len(c.messages) for c in conversations
            ),
            "turns_per_conversation": self.plan.turns,
            "turns_asked": self.plan.turns_asked,
            "turns_cut_by_context": self.plan.turns_asked - planned,
            "turns_planned": planned,
            "turns_served": len(self.served),
            "turns_completed": sum(self._completed.values()),
            # after a failed turn of their conversation (an interrupted run leaves others unserved)
            "turns_skipped": sum(
                len(c.messages) - self.failed_at[c.conversation_id] - 1
                for c in conversations
                if c.conversation_id in self.failed_at
            ),
        }
