"""The prefix cache's protocol around one prefill, in one place: a wave's jobs, built by the pool.

    PrefillWave.reserve(pool, prompts, shared)
        match each prompt in the prefix cache -> reserve it with its match (compacting if need be;
        one that does not fit is `busy`, holding nothing) -> take a checkpoint unit where its
        prefill writes one (checkpoints.py) -> one `PrefillJob` per reserved request
    model.prefill(pool, wave.jobs)
    wave.cache()      its full pages and its new checkpoint go to the prefix cache
    | wave.discard()  the prefill failed: the checkpoint units go back (the caller frees the requests)

A batch runs in waves (`split_batch`): a prompt that shares pages with an earlier one of the batch is
prefilled after it, from the checkpoint it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from distpool.memory.pool import DoesNotFit, Pool
from distpool.memory.prefix import PrefixMatch
from distpool.model_impl.prefill_job import PrefillJob
from prefill.checkpoints import Waves, checkpoint_depth, split_waves


def split_batch(pool: Pool, prompts: Sequence[Sequence[int]]) -> Waves:
    """The batch in two waves: prompts that share pages with an earlier one wait for it."""
    cache = pool.prefix_cache
    if cache is None or len(prompts) < 2:
        return Waves(first=list(range(len(prompts))))
    matched = [len(cache.match(prompt).pages) for prompt in prompts]
    return split_waves(prompts, matched, pool.page_size)


@dataclass
class PrefillWave:
    """The jobs of one wave, reserved in `pool`, and the checkpoint units their prefill writes.

    `busy`: request id -> why it did not fit (it holds nothing). `checkpoints`: request id ->
    (page depth, handle) of the checkpoint unit its snapshot fills, until `cache` or `discard`."""

    pool: Pool
    jobs: list[PrefillJob] = field(default_factory=list)
    busy: dict[str, str] = field(default_factory=dict)
    checkpoints: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def reserve(
        cls, pool: Pool, prompts: dict[str, Sequence[int]], shared: dict[str, int] | None = None
    ) -> PrefillWave:
        """Reserve each request of `prompts` (request id -> prompt) after its cached prefix and build
        its job. `shared[rid]`: the page boundary it shares with prompts of a later wave, where its
        checkpoint goes. Whatever fails but a request that does not fit gives everything back."""
        wave, cache = cls(pool), pool.prefix_cache
        matches: dict[str, PrefixMatch | None] = {}
        try:
            for rid, prompt in prompts.items():
                match = cache.match(prompt) if cache is not None else None
                try:
                    pool.reserve(rid, len(prompt), compact=True, prefix=match)
                except DoesNotFit as exc:
                    wave.busy[rid] = exc.reason
                    continue
                matches[rid] = match
            for rid, match in matches.items():
                wave.jobs.append(wave._job(rid, prompts[rid], match, (shared or {}).get(rid)))
        except BaseException:
            wave.discard()
            for rid in matches:
                pool.release(rid)
            raise
        return wave

    def _job(
        self, rid: str, prompt: Sequence[int], match: PrefixMatch | None, shared: int | None
    ) -> PrefillJob:
        """The job of a reserved request: after its match, from the match's checkpoint, with a
        snapshot into a fresh checkpoint unit at the depth `checkpoint_depth` picks (if any)."""
        cache, page_size = self.pool.prefix_cache, self.pool.page_size
        cached = match.num_tokens if match is not None else 0
        checkpoint = None
        if match is not None and match.checkpoint is not None:
            checkpoint = cache.checkpoint_slot(match.checkpoint)  # a match implies a cache
        snapshot = None
        if cache is not None and cache.needs_checkpoint:
            matched = len(match.pages) if match is not None else 0
            boundary = shared if shared is not None else cache.branch_depth(prompt)
            depth = checkpoint_depth(len(prompt), page_size, matched, boundary)
            if depth is not None:
                try:
                    handle, slot = cache.take_checkpoint()
                except DoesNotFit:  # no room for one: this prompt is cached without a checkpoint
                    pass
                else:
                    self.checkpoints[rid] = (depth, handle)
                    snapshot = (depth * page_size, slot)
        return PrefillJob(rid, prompt, cached=cached, checkpoint_slot=checkpoint, snapshot=snapshot)

    def cache(self) -> None:
        """After the prefill: offer each prompt's full pages and its new checkpoint to the cache."""
        cache = self.pool.prefix_cache
        if cache is None:
            return
        for job in self.jobs:
            written = self.checkpoints.pop(job.request_id, None)
            cache.cache_request(job.request_id, job.prompt, dict([written]) if written else None)

    def discard(self) -> None:
        """The prefill failed: give back the checkpoint units nothing was cached in."""
        if self.checkpoints:
            self.pool.prefix_cache.discard_checkpoints([handle for _, handle in self.checkpoints.values()])
            self.checkpoints.clear()
