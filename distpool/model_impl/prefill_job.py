"""One request of a prefill call (`PrefillJob`), what it computed (`Prefilled`), and the check every
model runs on a batch of jobs before it writes anything.

A request of n tokens, `cached` of them already in its pages:

    tokens   [0 ........... cached)      [cached ........................ n)
    pages    read only: shared cached    the request's own pages:
             pages, or its own rows      prefill writes exactly these rows
    state    checkpoint slot: the state  own slot: the state after n tokens
             after `cached` (read only)  snapshot slot: the state after `snapshot` tokens

Two ways to start after a prefix:
- **from the prefix cache** (a prefill worker; prefill/jobs.py builds these): the request was
  reserved with a match, its first `cached` tokens are the match's shared pages (a whole number of
  pages) and `checkpoint_slot` is the match's checkpoint, `pool.prefix_cache.checkpoint_slot(...)`;
- **in place** (a request that continues its own sequence, e.g. a new turn on the decode worker that
  holds it): `checkpoint_slot` is the request's own slot, which holds the state after `cached`
  tokens, and rows `[0, cached)` are in its own pages (any `cached`, page boundary or not). The
  caller extends the request to `len(tokens)` first:
  `PrefillJob(rid, tokens, cached=pool.num_tokens(rid), checkpoint_slot=pool.slot_id(rid))` before
  `pool.extend(rid, len(new_tokens))`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from distpool.memory.pool import Pool
from distpool.model.sampling import TokenPick
from distpool.model_impl.errors import (
    CACHED_NOT_AS_RESERVED,
    CACHED_OUT_OF_RANGE,
    DUPLICATE_REQUEST,
    EMPTY_PROMPT,
    NO_CHECKPOINT,
    SLOT_OUT_OF_RANGE,
    SLOTS_OVERLAP,
    SNAPSHOT_OUT_OF_RANGE,
    TOKENS_NOT_RESERVED,
    BatchRefused,
)


@dataclass(frozen=True)
class PrefillJob:
    """One request of a prefill call: its tokens, what of them is in the pool already, and where the
    state it starts from and any snapshot live (physical slot ids: valid until the next compaction)."""

    request_id: str
    prompt: Sequence[int]  # every token the request holds once prefilled, the cached prefix first
    cached: int = 0  # tokens whose K/V rows are in the request's pages already (see the module doc)
    checkpoint_slot: int | None = None  # the state after `cached` tokens; None when cached == 0
    snapshot: tuple[int, int] | None = None  # (tokens, physical slot): also write the state there
    pick: TokenPick | None = None  # how its first token is picked (model_impl/sampling.py); None: greedy

    @property
    def num_computed(self) -> int:
        """Tokens this prefill computes: the suffix after the cached prefix."""
        return len(self.prompt) - self.cached


@dataclass(frozen=True)
class Prefilled:
    """What a prefill computed for one job: the first generated token and how many prompt tokens ran."""

    request_id: str
    first_token: int
    computed_tokens: int


def prefilled(jobs: Sequence[PrefillJob], first_tokens: Sequence[int]) -> list[Prefilled]:
    """The results of `jobs`, given each one's first token."""
    return [
        Prefilled(job.request_id, int(token), job.num_computed)
        for job, token in zip(jobs, first_tokens, strict=True)
    ]


def check_jobs(pool: Pool, jobs: Sequence[PrefillJob], *, num_slots: int | None) -> list[PrefillJob]:
    """The jobs as a model runs them, or a `BatchRefused` naming the problem and the fix.
    `num_slots`: slot positions of the pool's state views; None for a model without recurrent
    state, whose checkpoints and snapshots are dropped."""
    ids = [job.request_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise BatchRefused(DUPLICATE_REQUEST, None, f"a batch names a request twice: {ids}", ids)
    checked = [_check_job(pool, job, num_slots) for job in jobs]
    _check_slots_apart(pool, checked)
    return checked


def _check_job(pool: Pool, job: PrefillJob, num_slots: int | None) -> PrefillJob:
    request_id, n, cached, page_size = job.request_id, len(job.prompt), job.cached, pool.page_size
    if n == 0:
        raise BatchRefused(
            EMPTY_PROMPT, request_id, f"request {request_id!r}: a prompt needs at least one token", 0
        )
    if (held := pool.num_tokens(request_id)) != n:
        raise BatchRefused(
            TOKENS_NOT_RESERVED,
            request_id,
            f"request {request_id!r} holds {held} tokens in the pool but its prompt has {n}",
            held,
            n,
        )
    in_place = num_slots is not None and cached > 0 and job.checkpoint_slot == pool.slot_id(request_id)
    if not 0 <= cached < n or (cached % page_size and not in_place):
        raise BatchRefused(
            CACHED_OUT_OF_RANGE,
            request_id,
            f"request {request_id!r}: cached={cached} must be a multiple of page_size ({page_size}) "
            f"below the prompt's {n} tokens",
            cached,
            (page_size, n),
        )
    prefix_cache = getattr(pool, "prefix_cache", None)  # test pools may lack the attribute
    if prefix_cache is not None:
        shared = len(prefix_cache.users.get(request_id, ())) * page_size
        if cached < shared or (cached > shared and not in_place):
            harm = "overwrite shared cached pages" if cached < shared else "read pages nobody wrote"
            raise BatchRefused(
                CACHED_NOT_AS_RESERVED,
                request_id,
                f"request {request_id!r} was reserved with {shared} cached tokens (shared pages) but "
                f"prefill was told cached={cached}, so it would {harm}",
                cached,
                shared,
            )
    if num_slots is None:  # no recurrent state: nothing to start from or to snapshot
        return replace(job, checkpoint_slot=None, snapshot=None)
    if cached == 0:
        job = replace(job, checkpoint_slot=None)
    elif job.checkpoint_slot is None:
        raise BatchRefused(
            NO_CHECKPOINT,
            request_id,
            f"request {request_id!r}: {cached} cached tokens but no checkpoint; the model's Mamba state "
            "after them must come from one",
            cached,
        )
    else:
        _check_slot(job.checkpoint_slot, num_slots, request_id, "checkpoint")
    if job.snapshot is not None:
        num_tokens, slot = job.snapshot
        if num_tokens % page_size or not cached < num_tokens <= n:
            raise BatchRefused(
                SNAPSHOT_OUT_OF_RANGE,
                request_id,
                f"request {request_id!r}: a snapshot after {num_tokens} tokens must lie on a page "
                f"boundary after the {cached} cached tokens and within the prompt's {n}",
                num_tokens,
                (cached, n),
            )
        _check_slot(slot, num_slots, request_id, "snapshot")
    return job


def _check_slot(slot: int, num_slots: int, request_id: str, what: str) -> None:
    if not 0 <= slot < num_slots:
        raise BatchRefused(
            SLOT_OUT_OF_RANGE,
            request_id,
            f"request {request_id!r}: {what} slot {slot} is outside the pool's {num_slots} slot positions",
            slot,
            num_slots,
        )


def _check_slots_apart(pool: Pool, jobs: Sequence[PrefillJob]) -> None:
    """Every slot the call writes (own slots, snapshots) is written once and read by no checkpoint
    but its own request's, continuing in place."""
    own = {job.request_id: pool.slot_id(job.request_id) for job in jobs}
    snapshots = [job.snapshot[1] for job in jobs if job.snapshot]
    read = {job.checkpoint_slot for job in jobs if job.checkpoint_slot not in (None, own[job.request_id])}
    if not snapshots and not read:
        return
    written = [*own.values(), *snapshots]
    if len(set(written)) != len(written) or read & set(written):
        raise BatchRefused(
            SLOTS_OVERLAP,
            None,
            f"a prefill batch writes slots {written} and reads checkpoints {sorted(read)}: a snapshot slot "
            "would overwrite a request's own slot, another snapshot or a checkpoint being read",
            written,
            sorted(read),
        )
