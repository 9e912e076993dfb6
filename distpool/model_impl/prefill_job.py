"""One prefill call, request by request: who owns which token range, checked once for every model.

A request of n prompt tokens, `cached` of them already in its pages (a cached prefix):

    tokens   [0 ........... cached)      [cached ........................ n)
    pages    shared cached pages:        the request's own pages:
             read only                   prefill writes exactly these rows
    state    checkpoint slot: the state  own slot: the state after n tokens
             after `cached` (read only)  snapshot slot: the state after `snapshot` tokens

The caller gets `cached` and the checkpoint from `pool.prefix_cache.match(prompt)` (`num_tokens`, and
`checkpoint_slot(match.checkpoint)`) and reserves the request with `prefix=match`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distpool.memory.pool import Pool


@dataclass(frozen=True)
class PrefillJob:
    """One request of a prefill call, checked against its pool."""

    request_id: str
    prompt: Sequence[int]
    cached: int  # tokens already in the request's pages: a multiple of page_size, < len(prompt)
    checkpoint_slot: int | None  # physical slot of the state after `cached` tokens; None when cached == 0
    snapshot: tuple[int, int] | None  # (tokens, physical slot): also write the state after that many

    @property
    def num_computed(self) -> int:
        """Tokens this prefill computes: the suffix after the cached prefix."""
        return len(self.prompt) - self.cached


def _entry(values: Sequence | None, i: int, what: str, count: int):
    if values is None:
        return None
    if len(values) != count:
        raise ValueError(f"{len(values)} entries in {what} for {count} requests. Fix: one per request")
    return values[i]


def plan_prefill(
    pool: Pool,
    request_ids: Sequence[str],
    prompts: Sequence[Sequence[int]],
    *,
    cached: Sequence[int] | None = None,
    checkpoints: Sequence[int | None] | None = None,
    snapshots: Sequence[tuple[int, int] | None] | None = None,
    num_slots: int | None,
) -> list[PrefillJob]:
    """The jobs of `prefill(pool, request_ids, prompts, cached=, checkpoints=, snapshots=)`, or a
    ValueError naming the fix. `num_slots`: slot positions of the pool's state views; None for a
    model without recurrent state, whose checkpoints and snapshots are ignored."""
    if len(request_ids) != len(prompts):
        raise ValueError(f"{len(request_ids)} request ids for {len(prompts)} prompts")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"a batch names a request twice: {list(request_ids)}")
    page_size, count = pool.page_size, len(request_ids)
    prefix_cache = getattr(pool, "prefix_cache", None)  # test pools may lack the attribute
    jobs = []
    for i, (request_id, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
        n = len(prompt)
        if n == 0:
            raise ValueError(f"request {request_id!r}: a prompt needs at least one token")
        if pool.num_tokens(request_id) != n:
            raise ValueError(
                f"request {request_id!r} holds {pool.num_tokens(request_id)} tokens in the pool but its "
                f"prompt has {n}. Fix: reserve it with len(prompt) tokens before prefill"
            )
        num_cached = _entry(cached, i, "cached", count) or 0
        if not 0 <= num_cached < n or num_cached % page_size:
            raise ValueError(
                f"request {request_id!r}: cached={num_cached} must be a multiple of page_size ({page_size}) "
                f"below the prompt's {n} tokens. Fix: pass the match's num_tokens "
                "(pool.prefix_cache.match(prompt) never covers the whole prompt)"
            )
        if prefix_cache is not None:
            shared = len(prefix_cache.users.get(request_id, ())) * page_size
            if num_cached != shared:
                harm = "overwrite shared cached pages" if num_cached < shared else "read pages nobody wrote"
                raise ValueError(
                    f"request {request_id!r} was reserved with {shared} cached tokens (shared pages) but "
                    f"prefill was told cached={num_cached}, so it would {harm}. Fix: pass "
                    "cached=match.num_tokens of the match it was reserved with"
                )
        checkpoint = _entry(checkpoints, i, "checkpoints", count)
        snapshot = _entry(snapshots, i, "snapshots", count)
        if num_slots is None:  # no recurrent state: nothing to start from or to snapshot
            checkpoint = snapshot = None
        elif num_cached == 0:
            checkpoint = None
        else:
            if checkpoint is None:
                raise ValueError(
                    f"request {request_id!r}: {num_cached} cached tokens but no checkpoint; the model's "
                    "Mamba state after them must come from one. Fix: pass checkpoints[i] = "
                    "pool.prefix_cache.checkpoint_slot(match.checkpoint)"
                )
            _check_slot(checkpoint, num_slots, request_id, "checkpoint")
        if snapshot is not None:
            depth, slot = snapshot
            if not num_cached < depth * page_size <= n:
                raise ValueError(
                    f"request {request_id!r}: a snapshot at page depth {depth} ({depth * page_size} tokens) "
                    f"must lie after the {num_cached} cached tokens and within the prompt's {n}. Fix: a "
                    f"depth in {num_cached // page_size + 1}..{n // page_size}, or no snapshot"
                )
            _check_slot(slot, num_slots, request_id, "snapshot")
            snapshot = (depth * page_size, slot)
        jobs.append(
            PrefillJob(
                request_id=request_id,
                prompt=prompt,
                cached=num_cached,
                checkpoint_slot=checkpoint,
                snapshot=snapshot,
            )
        )
    _check_slots_apart(pool, jobs)
    return jobs


def _check_slot(slot: int, num_slots: int, request_id: str, what: str) -> None:
    if not 0 <= slot < num_slots:
        raise ValueError(
            f"request {request_id!r}: {what} slot {slot} is outside the pool's {num_slots} slot positions. "
            "Fix: pass a physical slot id from pool.prefix_cache (take_checkpoint / checkpoint_slot)"
        )


def _check_slots_apart(pool: Pool, jobs: Sequence[PrefillJob]) -> None:
    """Every slot the call writes (own slots, snapshots) is written once and read by no checkpoint."""
    snapshots = [job.snapshot[1] for job in jobs if job.snapshot]
    read = {job.checkpoint_slot for job in jobs} - {None}
    if not snapshots and not read:
        return
    written = [pool.slot_id(job.request_id) for job in jobs] + snapshots
    if len(set(written)) != len(written) or read & set(written):
        raise ValueError(
            f"a prefill batch writes slots {written} and reads checkpoints {sorted(read)}: a snapshot slot "
            "would overwrite a request's own slot, another snapshot or a checkpoint being read. "
            "Fix: take a fresh checkpoint unit (pool.prefix_cache.take_checkpoint()) for each snapshot"
        )
