"""The transformers runner: a `PoolModel` whose arithmetic is Hugging Face's own modeling code.

Every forward hands the model a cache over our memory (`state_cache.pooled_cache`): the recurrent
states are the requests' slot bytes, and the attention modules call the registered paged attention
function, which keeps K/V in the requests' pages. Nothing of a request lives outside the pool between
calls, so envelopes move, compact and transfer as with any other model.

Prefill runs one request at a time, in chunks split where a state snapshot is due:

    tokens  [0 ...... cached) [cached ........ snapshot) [snapshot ...... n)
    state   checkpoint slot -> own slot (copied)         own slot -> snapshot slot (copied)

A chunk after position 0 continues the state before it; an architecture whose multi-token scan cannot
start from a given state (Jamba) runs such a chunk token by token. Decode runs every request of the
step as one batch: one token each, at its own position, its keys masked to its own length.
Greedy tokens are the argmax of float32 logits, as `generate` takes them; sampled ones are picked
by `model_impl.sampling` in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distpool.memory.pool import Pool
from distpool.model.sampling import TokenPick
from distpool.model.spec import ModelSpec
from distpool.model_impl.decode_job import check_token_ids, plan_decode
from distpool.model_impl.errors import PoolsSizedOtherwise
from distpool.model_impl.hf.layout import check_allocation, runner_spec
from distpool.model_impl.hf.loader import load_model
from distpool.model_impl.hf.paged_attention import PAGED_ATTENTION, PagedBatch, paged_forward
from distpool.model_impl.hf.pool_views import PoolViews
from distpool.model_impl.hf.source import HFSource
from distpool.model_impl.hf.state_cache import (
    SlotStates,
    StateCopies,
    check_states_kept,
    pooled_cache,
)
from distpool.model_impl.hf.support import check_supported
from distpool.model_impl.hf.transformers_internals import cache_argument
from distpool.model_impl.pool_model import Mismatch, PoolModel
from distpool.model_impl.prefill_job import Prefilled, PrefillJob, check_jobs, prefilled
from distpool.model_impl.sampling import pick_tokens


class TransformersRunner(PoolModel):
    """Generation with transformers' modeling code of a supported hybrid architecture.

    `spec` is what the pools were sized with (`layout.runner_spec` of the same model): the loaded
    model must agree with it, and with what transformers allocates, or loading fails with both named.
    It keeps no record of requests, so `admit` and `check` have nothing to verify.
    """

    name = "transformers"
    verifies = False

    def __init__(
        self, spec: ModelSpec, source: HFSource, *, seed: int = 0, device: str | torch.device = "cpu"
    ):
        architecture = check_supported(spec)
        self.continues_in_one_pass = architecture.continues_in_one_pass
        self.device = torch.device(device)
        self.model = load_model(source, device=self.device, seed=seed, attention=PAGED_ATTENTION)
        loaded = runner_spec(self.model, spec, source.dtype)
        if loaded.layout_fields() != spec.layout_fields():
            raise PoolsSizedOtherwise(
                str(source.path), loaded.full_attention, loaded.mamba, spec.full_attention, spec.mamba
            )
        self._cache_argument = cache_argument(self.model)
        check_allocation(self.model, spec, cache_argument=self._cache_argument)
        self.spec = spec
        self.vocab_size = self.model.config.vocab_size
        self.copies = StateCopies()
        self._views: PoolViews | None = None  # the last pool's, valid while that pool lives

    def _views_of(self, pool: Pool) -> PoolViews:
        """The views of `pool`, built on its first forward (a worker serves from one pool)."""
        if self._views is None or self._views.pool is not pool:
            self._views = PoolViews.of(pool, self.spec, self.copies)
        return self._views

    # ---- one forward over pool memory ---------------------------------------------------------
    def _forward(
        self, pool: Pool, page_table: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, states
    ) -> torch.Tensor:
        """Next-token float32 logits (B, vocab) of `tokens` (B, T) at `positions` (B, T), reading and
        writing K/V through `page_table` (B, pages) and the recurrent `states` per Mamba layer."""
        num_past = int(positions[:, 0].max())
        kernel = self.spec.mamba.tensors[0].shape[-1] if self.spec.mamba else 0
        cache = pooled_cache(self.spec, states, kernel=kernel, num_past=num_past)
        arguments = {self._cache_argument: cache}
        batch = PagedBatch.over(
            self._views_of(pool).kv,
            pool.page_size,
            page_table,
            positions,
            device=pool.buffer.device,
            dtype=self.model.dtype,
        )
        with torch.no_grad(), paged_forward(batch):
            out = self.model(
                input_ids=tokens.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                logits_to_keep=1,
                **arguments,
            )
        check_states_kept(cache, states)
        return out.logits[:, -1].float()

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, pool: Pool, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        """See `PoolModel.prefill`: each prompt after its cached prefix, from its checkpoint's state;
        its K/V rows into its own pages, its final state into its slot, snapshots where asked."""
        slots = self._views_of(pool).slots
        jobs = check_jobs(pool, jobs, num_slots=slots.num_slots)
        for job in jobs:
            check_token_ids(job.prompt, self.vocab_size, "prompt")
        return prefilled(
            jobs, [pick_tokens(self._prefill_one(pool, slots, job), [job.pick])[0] for job in jobs]
        )

    def _prefill_one(self, pool: Pool, slots: SlotStates, job: PrefillJob) -> torch.Tensor:
        """The job's last-token logits (1, vocab), its K/V and state written."""
        slot = pool.slot_id(job.request_id)
        if slot is None:
            raise ValueError(f"request {job.request_id!r} holds no state slot")
        if job.cached and job.checkpoint_slot != slot:  # else it continues in place
            if job.checkpoint_slot is None:
                raise ValueError(
                    f"request {job.request_id!r}: {job.cached} cached tokens without a checkpoint"
                )
            slots.copy(job.checkpoint_slot, slot)
        page_table = pool.page_ids(job.request_id).cpu()[None]
        # A snapshot at the prompt's end leaves the second chunk empty: the snapshot is the final state.
        bounds = sorted({job.cached, *([job.snapshot[0]] if job.snapshot else []), len(job.prompt)})
        logits = None
        for start, stop in zip(bounds, bounds[1:], strict=False):
            if start > 0 and not self.continues_in_one_pass:
                steps = [(t, t + 1) for t in range(start, stop)]  # its scan cannot start from a state
            else:
                steps = [(start, stop)]
            for first, last in steps:
                tokens = torch.tensor([list(job.prompt[first:last])])
                positions = torch.arange(first, last)[None]
                logits = self._forward(pool, page_table, positions, tokens, slots.views(slot))
            if job.snapshot is not None and stop == job.snapshot[0]:
                slots.copy(slot, job.snapshot[1])
        if logits is None:
            raise ValueError(f"request {job.request_id!r}: an empty prompt")
        return logits

    # ---- decode -------------------------------------------------------------------------------
    def decode_step(
        self,
        pool: Pool,
        request_ids: Sequence[str],
        last_tokens: Sequence[int],
        picks: Sequence[TokenPick | None] | None = None,
    ) -> list[int]:
        """One token for each request (picked as `picks` says; None: greedy), as one batch. Each
        request was prefilled and then extended by one token (`pool.extend(rid, 1)`) for the token
        it is fed (`last_tokens`)."""
        job = plan_decode(pool, request_ids, last_tokens, self.vocab_size)
        if job is None:
            return []
        page_table, positions = job.page_table, job.positions[:, None]
        tokens = torch.tensor(list(last_tokens))[:, None]
        slots = self._views_of(pool).slots
        slot_ids = [pool.slot_id(r) for r in request_ids]
        if len(request_ids) == 1:
            logits = self._forward(pool, page_table, positions, tokens, slots.views(slot_ids[0]))
        else:
            index = torch.tensor(slot_ids)
            gathered = slots.gather(index)
            logits = self._forward(pool, page_table, positions, tokens, gathered)
            slots.scatter(index, gathered)
        return pick_tokens(logits, picks)

    def admit(self, pool: Pool, request_id: str, prompt: Sequence[int], first_token: int) -> Mismatch | None:
        return None

    def check(self, pool: Pool, request_id: str) -> Mismatch | None:
        return None

    def forget(self, request_id: str) -> None:
        return None
