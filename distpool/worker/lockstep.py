"""How the ranks of a TP group keep their model calls in step (`Lockstep`).

Every all-reduce of a tensor-parallel model pairs up across ranks by call order, so every rank must
make the same model calls, with the same requests and token counts, in the same order. The ranks
receive their shards at different times and serve concurrent driver calls, so they agree first:

    prefill wave    `same(signature)`: every rank reserved the same jobs (ids, lengths, cached
                    prefix); else every rank gives the wave back (busy, retried) and none computes it
    decode step     `go(stop)` outside the worker's lock, then under it `agree(ids)`: the requests
                    every rank holds ready, in rank 0's order, and whether this rank lacks one that
                    another holds (its shard has not landed here yet: the next round waits for it)

`Lockstep` is also the process group the model all-reduces over (`size`, `rank`, `allreduce`): the
workers build their model before the ranks can form a group (every rank must have started first),
so the group is bound later (`bind`, from `WorkerBase.join_tp_group`); a call before that is a bug.

A collective that fails (a rank died, or the group timed out) raises `GroupBroken`: the group's
collectives are out of step for good, and the rank must restart with its whole group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distpool.facts import Facts
from distpool.model_impl.errors import TpGroupMismatch
from distpool.model_impl.prefill_job import PrefillJob


class GroupBroken(Facts, RuntimeError):
    """Rank `rank` of the TP group of `tp` ranks cannot run a collective: the group had not formed
    (`formed` False: it was never bound to one), or a collective on it failed (`cause`, the process
    group's error as it read) and the group cannot be used again."""

    def __init__(self, rank: int, tp: int, *, formed: bool, cause: str = "") -> None:
        self.rank, self.tp, self.formed, self.cause = rank, tp, formed, cause
        if formed:
            message = f"a collective of the TP group failed: {cause}"
        else:
            message = f"rank {rank} of TP {tp} computed before its group formed"
        super().__init__(message)


def id_hash(text: str) -> int:
    """A request id as a signed 64-bit number (what crosses in a collective)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


class Lockstep:
    """Rank `rank` of a TP group of `tp` ranks; collectives on `device`'s tensors (CPU: Gloo)."""

    def __init__(self, *, tp: int, rank: int, device: torch.device) -> None:
        if tp <= 1 or not 0 <= rank < tp:
            raise ValueError(f"lockstep needs TP > 1 and a rank in [0, TP); got TP {tp}, rank {rank}")
        self._tp, self._rank, self.device = tp, rank, device
        self._group: dist.ProcessGroup | None = None

    # ---- the process group, as the model sees it ------------------------------------------------
    def size(self) -> int:
        return self._tp

    def rank(self) -> int:
        return self._rank

    @property
    def bound(self) -> bool:
        return self._group is not None

    def bind(self, group: dist.ProcessGroup) -> None:
        """The group the ranks formed: `tp` ranks, this one at `rank`."""
        if (group.size(), group.rank()) != (self._tp, self._rank):
            raise TpGroupMismatch(self._tp, self._rank, group.size(), group.rank())
        self._group = group

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        """The model's sum over the group, done by the time it returns (the model then waits on
        what it returns, as on a process group's work)."""
        self._collective(lambda group: group.allreduce(tensors))
        return _Done()

    def _collective(self, start: Callable[[dist.ProcessGroup], dist.Work]) -> None:
        """Run one collective to its end; GroupBroken if it fails (a rank died, or it timed out)."""
        if self._group is None:
            raise GroupBroken(self._rank, self._tp, formed=False)
        try:
            start(self._group).wait()
        except Exception as exc:  # Gloo raises RuntimeError (DistError): the group is out of step
            raise GroupBroken(self._rank, self._tp, formed=True, cause=str(exc)) from exc

    # ---- agreements -----------------------------------------------------------------------------
    def _gather(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `values` (int64, the same length on every rank), in rank order."""
        local = values.to(self.device)
        out = [torch.empty_like(local) for _ in range(self._tp)]
        self._collective(lambda group: group.allgather([out], [local]))
        return [t.cpu() for t in out]

    def go(self, stop: bool) -> bool:
        """Whether the ranks step on: False once any rank stops (every rank gets the same answer)."""
        flags = self._gather(torch.tensor([int(stop)], dtype=torch.int64))
        return not any(int(f.item()) for f in flags)

    def same(self, signature: int) -> bool:
        """Whether every rank passed the same `signature` (see `wave_signature`)."""
        values = self._gather(torch.tensor([signature], dtype=torch.int64))
        return all(int(v.item()) == signature for v in values)

    def common(self, ids: Sequence[str]) -> list[str]:
        """The ids every rank passed, in rank 0's order (the same list on every rank)."""
        return self.agree(ids).common

    def agree(self, ids: Sequence[str]) -> Agreement:
        """The ids every rank passed, in rank 0's order (`common`, the same on every rank), and
        whether another rank passed one this rank did not (`lacking`, this rank's own answer)."""
        own = {id_hash(rid): rid for rid in ids}
        counts = [int(c.item()) for c in self._gather(torch.tensor([len(own)], dtype=torch.int64))]
        if max(counts) == 0:  # every rank sees the same counts: none gathers further
            return Agreement(common=[], lacking=False)
        padded = torch.zeros(max(counts), dtype=torch.int64)
        padded[: len(own)] = torch.tensor(list(own), dtype=torch.int64)
        gathered = [g[:n].tolist() for g, n in zip(self._gather(padded), counts, strict=True)]
        held = [set(ranks_ids) for ranks_ids in gathered]
        common = [own[h] for h in gathered[0] if h in own and all(h in s for s in held[1:])]
        lacking = any(not ranks_ids <= own.keys() for ranks_ids in held)
        return Agreement(common=common, lacking=lacking)


@dataclass(frozen=True)
class Agreement:
    """What `Lockstep.agree` found: the ids every rank holds (rank 0's order), and whether another
    rank holds one this rank does not (yet)."""

    common: list[str]
    lacking: bool


class _Done:
    """A collective already complete."""

    def wait(self) -> bool:
        return True


def wave_signature(jobs: Sequence[PrefillJob]) -> int:
    """One number for a prefill wave's jobs in order (id, tokens, cached prefix, snapshot point):
    equal on two ranks when they are about to make the same model calls."""
    digest = hashlib.blake2b(digest_size=8)
    for job in jobs:
        snapshot = job.snapshot[0] if job.snapshot is not None else -1
        digest.update(f"{job.request_id}\0{len(job.prompt)}\0{job.cached}\0{snapshot}\n".encode())
    return int.from_bytes(digest.digest(), "little", signed=True)
