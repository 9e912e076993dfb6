"""The driver's handle on a worker that is a TP group of rank actors (`TpGroup`).

It stands where one actor handle stands (`group.reserve.remote(...)`, awaited): each call goes to
every rank at once, and its answer is rank 0's once the ranks agree. The ranks reserve, prefill,
cancel and release the same requests, each on its own pool shard, so they must answer alike; where
they cannot (a pool a request fits on one rank and not yet on another), the group undoes what the
others did and answers as the refusing rank did. A request finishes when it finished on every rank:
results are held until then, and the merged one is verified only if every rank verified its shard.
Calls that run the model (`IN_TURN`) go to the group one at a time, so every rank runs them in the
same order (worker/lockstep.py). A rank that raises (it died: `RayActorError`) makes the call
raise, and the driver loses the whole group (`serving.deploy.recovery`), which goes down and comes back as
one. From the moment it is taken down (`down`) until its new ranks formed their group (`up`), no
`IN_TURN` call reaches the ranks: one waiting for its turn meanwhile, or made then, raises
`GroupDown` (a new rank would compute before its group formed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from distpool.facts import Facts
from distpool.worker.messages import (
    DecodeEvents,
    DecodeFailed,
    DecodeFinished,
    DecodeResult,
    PrefillBusy,
    PrefillCause,
    PrefillFailed,
    PrefillResult,
    PrefillSent,
)
from transfer.wire import FailureKind

# Calls that run the model: the ranks must run them in the same order (every all-reduce pairs up by
# call order, worker/lockstep.py), so the group makes them one at a time.
IN_TURN = frozenset({"prefill_and_send"})
# Every call the driver makes of a worker that may be a group (`TpGroup.settles` says how each is
# settled; the ranks must answer the others alike, `_agree`).
CALLS = frozenset(
    {
        "reserve", "cancel", "prefill_and_send", "next_events", "next_finished", "progress",
        "local_prefill", "plan_fault", "channel_broken", "peer_lost", "ping",
    }
)  # fmt: skip
Settle = Callable[..., Awaitable[Any]]  # (refs, *the call's arguments) -> the group's answer


class NotAGroupCall(Facts, AttributeError):
    """Method `method` asked of TP group `group`, which makes only the calls in `CALLS`."""

    def __init__(self, group: str, method: str) -> None:
        known = ", ".join(sorted(CALLS))
        super().__init__(f"{group} is a TP group: it makes the calls {known}, not {method!r}")
        self.group, self.method = group, method


class RanksDisagree(RuntimeError):
    """The ranks of one group answered one call differently: a bug, never retried."""


class GroupDown(RuntimeError):
    """The group was taken down (a rank died) before this call's turn came: it was not made."""


class GroupCall:
    """One method called on every rank (the calls are made at once, awaited or not); awaiting it
    gives the group's answer."""

    def __init__(self, settle: Callable[[], Awaitable[Any]]) -> None:
        self._settle = settle

    def __await__(self):
        return self._settle().__await__()


class _Method:
    def __init__(self, group: TpGroup, name: str) -> None:
        self.group, self.name = group, name

    def remote(self, *args, **kwargs) -> GroupCall:
        settle: Settle = self.group.settles.get(self.name, self.group._agree)
        if self.name in IN_TURN:
            call = functools.partial(self._call, args, kwargs)  # made once its turn comes
            life = self.group.life
            return GroupCall(lambda: self.group._in_turn(call, settle, args, kwargs, life))
        refs = self._call(args, kwargs)
        return GroupCall(lambda: settle(refs, *args, **kwargs))

    def _call(self, args: tuple, kwargs: dict) -> list[ray.ObjectRef]:
        return [getattr(rank, self.name).remote(*args, **kwargs) for rank in self.group.ranks]


async def _answers(refs: list[ray.ObjectRef]) -> list[Any]:
    """Every rank's answer; the first error raised (a dead rank's first, so the group is lost)."""
    answers = await asyncio.gather(*refs, return_exceptions=True)
    errors = [a for a in answers if isinstance(a, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, RayActorError)), errors[0])
    return answers


class TpGroup:
    """Rank actors `ranks` (rank 0 first) of worker `name`, called as one."""

    def __init__(self, name: str, ranks: list[ray.actor.ActorHandle]) -> None:
        if len(ranks) < 2:
            raise ValueError("a worker of one rank is its actor handle, not a TpGroup")
        self.name, self.ranks = name, ranks
        # request id -> rank -> its result, until every rank finished the request
        self._finished: dict[str, dict[int, DecodeResult]] = {}
        self._turn: asyncio.Lock | None = None  # held by the IN_TURN call in flight
        self._turn_loop: asyncio.AbstractEventLoop | None = None  # the event loop `_turn` serves
        self.life = 0  # how often the group was taken down
        self.formed = True  # False from `down` until `up`
        # How each call's answers become the group's (the others: `_agree`).
        self.settles: dict[str, Settle] = {
            "ping": self._settle_ping,
            "reserve": self._settle_reserve,
            "cancel": self._settle_cancel,
            "channel_broken": self._settle_channel_broken,
            "prefill_and_send": self._settle_prefill_and_send,
            "next_finished": self._settle_next_finished,
            "next_events": self._settle_next_events,
            "progress": self._settle_progress,
            "plan_fault": self._settle_plan_fault,
        }

    def down(self) -> None:
        """The group is being taken down (a rank died): IN_TURN calls not made yet never will be."""
        self.life += 1
        self.formed = False

    def up(self) -> None:
        """The group's new ranks formed their group: IN_TURN calls reach them again."""
        self.formed = True

    async def _in_turn(
        self, call: Callable[[], list[ray.ObjectRef]], settle: Settle, args, kwargs, life: int
    ) -> Any:
        """Make `call` on every rank once the previous IN_TURN call has been answered, unless the
        group went down since the call was made (`life`), or is down now."""
        loop = asyncio.get_running_loop()
        if self._turn is None or self._turn_loop is not loop:  # one deployment may serve several runs
            self._turn, self._turn_loop = asyncio.Lock(), loop
        async with self._turn:
            if life != self.life or not self.formed:
                raise GroupDown(f"{self.name} was taken down before the call was made")
            return await settle(call(), *args, **kwargs)

    def __getattr__(self, method: str) -> _Method:
        if method not in CALLS:
            raise NotAGroupCall(self.name, method)
        return _Method(self, method)

    async def _agree(self, refs: list[ray.ObjectRef], *_, **__) -> Any:
        answers = await _answers(refs)
        if any(a != answers[0] for a in answers[1:]):
            raise RanksDisagree(f"the ranks of {self.name} answered differently: {answers}")
        return answers[0]

    async def _settle_plan_fault(self, refs: list[ray.ObjectRef], *_) -> bool:
        """Whether every rank dropped a plan not taken: a rank whose transfer took its plan (and
        one that did not get to its transfer) may answer differently."""
        return all(await _answers(refs))

    async def _settle_ping(self, refs: list[ray.ObjectRef]) -> str:
        await _answers(refs)  # each rank answers with its own name
        return self.name

    async def _settle_reserve(self, refs: list[ray.ObjectRef], request_id: str, *_) -> None:
        """Reserved on every rank, or on none: when a rank refused (no room there yet while its
        peers had room, or it died), the others give theirs up, and its refusal is raised."""
        answers = await asyncio.gather(*refs, return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if not errors:
            return
        held = [rank for rank, a in zip(self.ranks, answers, strict=True) if not isinstance(a, BaseException)]
        # notify: a header already on its way to those ranks is refused at once, not left waiting
        await asyncio.gather(
            *(rank.cancel.remote(request_id, notify=True) for rank in held), return_exceptions=True
        )
        self.forget(request_id)
        raise next((e for e in errors if isinstance(e, RayActorError)), errors[0])

    async def _settle_cancel(self, refs: list[ray.ObjectRef], request_id: str, **_) -> bool:
        """Whether some rank held the request (what the ranks reported of it is dropped)."""
        held = any(await _answers(refs))
        self.forget(request_id)
        return held

    async def _settle_channel_broken(self, refs: list[ray.ObjectRef], *_) -> bool:
        return any(await _answers(refs))

    async def _settle_prefill_and_send(self, refs: list[ray.ObjectRef], *_) -> dict[str, PrefillResult]:
        """Per request: sent when every rank sent its shard (the bytes summed, the slowest
        transfer's time); else busy (any rank had no room) or failed (a rank's failure)."""
        answers: list[dict[str, PrefillResult]] = await _answers(refs)
        return {rid: merge_prefill([a[rid] for a in answers]) for rid in answers[0]}

    async def _settle_next_finished(self, refs: list[ray.ObjectRef], *_) -> dict[str, DecodeResult]:
        """The requests every rank has finished by now, merged; the others wait here for the rest."""
        return self._merge_finished(await _answers(refs))

    async def _settle_next_events(self, refs: list[ray.ObjectRef], *_, **__) -> DecodeEvents:
        """The requests every rank has finished by now, merged (the others wait here for the rest),
        and rank 0's new tokens and cache news (the ranks step together: every rank makes the same
        ones, and caches and evicts the same prefixes)."""
        answers: list[DecodeEvents] = await _answers(refs)
        finished = self._merge_finished([a.finished for a in answers])
        return DecodeEvents(finished=finished, tokens=answers[0].tokens, cache=answers[0].cache)

    def _merge_finished(self, answers: list[dict[str, DecodeResult]]) -> dict[str, DecodeResult]:
        for rank, answer in enumerate(answers):
            for rid, result in answer.items():
                self._finished.setdefault(rid, {})[rank] = result
        done = [rid for rid, results in self._finished.items() if len(results) == len(self.ranks)]
        return {rid: merge_decode([r for _, r in sorted(self._finished.pop(rid).items())]) for rid in done}

    async def _settle_progress(self, refs: list[ray.ObjectRef], *_) -> dict[str, int]:
        """Per request every rank holds, the least progress a rank made on it."""
        answers: list[dict[str, int]] = await _answers(refs)
        return {rid: min(a[rid] for a in answers) for rid in answers[0] if all(rid in a for a in answers)}

    def forget(self, request_id: str) -> None:
        """Drop what the ranks reported of an attempt given up (a retry starts afresh)."""
        self._finished.pop(request_id, None)


def merge_prefill(results: list[PrefillResult]) -> PrefillResult:
    """One request's prefill over every rank (rank 0 first)."""
    failed = [r for r in results if isinstance(r, PrefillFailed)]
    if failed:
        return next((r for r in failed if not r.retry), failed[0])
    busy = [r for r in results if isinstance(r, PrefillBusy)]
    if busy:
        return busy[0]
    sent: list[PrefillSent] = results  # type: ignore[assignment]
    if len({r.computed_tokens for r in sent}) > 1:
        reason = f"the prefill ranks computed different token counts: {[r.computed_tokens for r in sent]}"
        return PrefillFailed(
            kind=FailureKind.INTERNAL, reason=reason, retry=False, cause=PrefillCause.RANKS_DISAGREE
        )
    return dataclasses.replace(
        sent[0],
        transfer_bytes=sum(r.transfer_bytes for r in sent),
        transfer_s=max(r.transfer_s for r in sent),
        source_runs=sum(r.source_runs for r in sent),
    )


def merge_decode(results: list[DecodeResult]) -> DecodeResult:
    """One request's decode over every rank (rank 0 first): failed if any rank failed (corrupt
    first); else rank 0's tokens, which every rank must have generated, verified only if every
    rank verified its shard, and each rank's received bytes."""
    failed = [r for r in results if isinstance(r, DecodeFailed)]
    if failed:
        return next((r for r in failed if r.corrupt), failed[0])
    done: list[DecodeFinished] = results  # type: ignore[assignment]
    if any(r.tokens != done[0].tokens for r in done):
        reason = f"the decode ranks generated different tokens: {[r.tokens for r in done]}"
        return DecodeFailed(kind=FailureKind.INTERNAL, reason=reason, retry=False)
    return dataclasses.replace(
        done[0],
        decode_s=max(r.decode_s for r in done),
        admit_s=max(r.admit_s for r in done),
        destination_runs=sum(r.destination_runs for r in done),
        verified=all(r.verified for r in done),
        received_bytes=tuple(b for r in done for b in r.received_bytes),
    )
