"""A small, seeded, deterministic Nemotron-H style hybrid model that runs on any `Pool`.

It exists to prove that pool memory holds what a model needs: K/V in pages, Mamba2 state in
slots, moved, transferred and compacted without changing a single greedy token. Every step reads
physical page and slot ids from the pool afresh (compaction between steps may move envelopes).

Layer indices passed to `pool.kv_view` / `pool.state_view` are the model's own layer numbers
(the entries of `spec.full_attention_layers` / `spec.mamba_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from distpool.memory.pool import Pool
from distpool.model.sampling import TokenPick
from distpool.model.spec import ModelSpec
from distpool.model_impl.decode_job import check_token_ids, plan_decode
from distpool.model_impl.errors import EMPTY_PROMPT, BatchRefused
from distpool.model_impl.pool_model import Mismatch, PoolModel
from distpool.model_impl.prefill_job import Prefilled, PrefillJob, check_jobs, prefilled
from distpool.model_impl.reference.attention import AttentionLayer
from distpool.model_impl.reference.layer_stack import build_layers
from distpool.model_impl.reference.layers import COMPUTE_DTYPE, WeightFactory, rms_norm
from distpool.model_impl.reference.mamba2 import Mamba2Layer
from distpool.model_impl.reference.past import Pair, Past
from distpool.model_impl.reference.support import check_supported
from distpool.model_impl.reference.tensor_parallel import TPRank
from distpool.model_impl.sampling import pick_tokens

if TYPE_CHECKING:
    import torch.distributed as dist

_LOGIT_STD = 4.0  # wide logits keep greedy argmax far from ties between equivalent computations


class ReferenceModel(PoolModel):
    """Greedy Nemotron-H style hybrid (Mamba2, attention, MLP layers) with seeded weights.

    Built from a `ModelSpec` alone: full-attention layers are GQA attention, Mamba layers Mamba2,
    every other layer a relu^2 MLP. Weights depend only on the spec's dimensions and `seed`, whatever
    the device. Raises `ImplCannotRun` for specs `unsupported_reason` refuses.
    It keeps no record of requests, so `admit` and `check` have nothing to verify.

    Tensor parallel: `ReferenceModel.for_rank(spec, tp=N, rank=r, group=pg)` is rank r of the same
    model split over N ranks (see `tensor_parallel`). It runs on a pool built from its `spec`, the
    rank's shard of the model's spec; every rank of the group makes the same calls and gets the
    same tokens. The plain constructor is TP 1.
    """

    name = "reference"
    verifies = False

    def __init__(
        self, spec: ModelSpec, *, seed: int = 0, device: str | torch.device = "cpu", tp: TPRank | None = None
    ) -> None:
        check_supported(spec)
        self.tp = tp if tp is not None else TPRank.of(spec, tp=1, rank=0, group=None)
        if self.tp.shard.model != spec:
            raise ValueError(
                f"rank {self.tp.shard.rank}'s shard is of {self.tp.shard.model.source}, not {spec.source}"
            )
        self.spec = self.tp.shard.spec  # what the rank's pool stores (the spec itself at TP 1)
        self.seed = seed
        self.device = torch.device(device)
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.eps = spec.norm_eps
        weights = WeightFactory(seed, self.device)  # draw order: embedding, layers, lm_head
        self.embedding = weights.normal(self.vocab_size, self.hidden_size, std=1.0)
        self.layers = build_layers(self.tp, weights)
        self.lm_head = weights.normal(
            self.hidden_size, self.vocab_size, std=_LOGIT_STD * self.hidden_size**-0.5
        )

    @classmethod
    def for_rank(
        cls,
        spec: ModelSpec,
        *,
        tp: int,
        rank: int,
        group: dist.ProcessGroup | None,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> ReferenceModel:
        """Rank `rank` of the model split over `tp` ranks, all-reducing over `group`: the process
        group of exactly those ranks in rank order (Gloo on CPU, NCCL on CUDA; None at TP 1), on
        `device`. ValueError (the shard rules') for a TP size `spec` cannot shard, or a wrong group."""
        check_supported(spec)
        return cls(spec, seed=seed, device=device, tp=TPRank.of(spec, tp=tp, rank=rank, group=group))

    # ---- forward passes ------------------------------------------------------------------
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0, self.eps) @ self.lm_head

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        check_token_ids(tokens, self.vocab_size, what)

    def _forward_sequence(
        self, tokens: Sequence[int], past: Past | None = None
    ) -> tuple[torch.Tensor, dict[int, Pair], dict[int, Pair]]:
        """Tokens after `past` (None: from empty cache) -> last-token logits (vocab,), the tokens' own
        K/V per attention layer ((T, kv_heads, head_dim) each), final (conv, ssm) per Mamba layer."""
        if len(tokens) == 0:
            raise BatchRefused(EMPTY_PROMPT, None, "a prompt needs at least one token", 0)
        self._check_tokens(tokens, "prompt")
        past = past if past is not None else Past()
        x = self.embedding[torch.tensor(list(tokens), device=self.device)]  # (T, hidden)
        kv: dict[int, Pair] = {}
        states: dict[int, Pair] = {}
        # (T, past + T): token t sees every past token and the new ones up to itself
        causal = torch.ones(len(tokens), past.num_tokens + len(tokens), dtype=torch.bool, device=self.device)
        causal = causal.tril(diagonal=past.num_tokens)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, 1.0, self.eps)
            if isinstance(layer, AttentionLayer):
                q, k, v = layer.qkv(h)
                kv[i] = (k, v)
                if i in past.kv:
                    k, v = torch.cat([past.kv[i][0], k]), torch.cat([past.kv[i][1], v])
                out = layer.attend(q[None], k[None], v[None], causal[None])[0]
            elif isinstance(layer, Mamba2Layer):
                out, conv_state, ssm_state = layer.forward_sequence(h, *past.states.get(i, (None, None)))
                states[i] = (conv_state, ssm_state)
            else:
                out = layer(h)
            x = x + out
        return self._logits(x[-1]), kv, states

    def _past(self, pool: Pool, job: PrefillJob) -> Past | None:
        """What the job's suffix starts from, read from the pool: None without a cached prefix."""
        if not job.cached:
            return None
        if job.checkpoint_slot is None:  # check_jobs insists on one for a Mamba model
            raise ValueError(f"request {job.request_id!r}: {job.cached} cached tokens without a checkpoint")
        return Past.read(
            pool,
            job.request_id,
            job.cached,
            job.checkpoint_slot,
            attention_layers=self.spec.full_attention_layers,
            mamba_layers=self.spec.mamba_layers,
            device=self.device,
        )

    def _compute(
        self, job: PrefillJob, past: Past | None
    ) -> tuple[torch.Tensor, dict[int, Pair], dict[int, Pair], dict[int, Pair] | None]:
        """The job's suffix from `past`, in two chunks split at its snapshot if it has one ->
        (last-token logits, the suffix's K/V, the final state, the state at the snapshot or None)."""
        stop = len(job.prompt) if job.snapshot is None else job.snapshot[0]
        logits, kv, states = self._forward_sequence(job.prompt[job.cached : stop], past)
        snapshot = None if job.snapshot is None else states
        if stop < len(job.prompt):
            past = (past or Past()).then(stop - job.cached, kv, states)
            logits, rest, states = self._forward_sequence(job.prompt[stop:], past)
            kv = {i: (torch.cat([k, rest[i][0]]), torch.cat([v, rest[i][1]])) for i, (k, v) in kv.items()}
        return logits, kv, states, snapshot

    def next_token_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """The logits (vocab,) after `tokens`, from zero state and no cache: the oracle's view."""
        return self._forward_sequence(tokens)[0]

    def generate_nocache(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """The oracle: full recompute from zero state for every new token, no cache at all."""
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            logits, _, _ = self._forward_sequence(tokens)
            tokens.append(int(logits.argmax()))
        return tokens[len(prompt) :]

    # ---- cached passes through a pool ---------------------------------------------------------
    def prefill(self, pool: Pool, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        """Run each prompt after its cached prefix (its pages' K/V and its checkpoint's state, read
        from the pool), write the suffix's K/V rows into its pages, its final state into its slot and
        any snapshot's state into the snapshot slot (see `PoolModel.prefill`); first tokens as each job's
        `pick` says (greedy without one).
        """
        num_slots = pool.state_view(self.spec.mamba_layers[0])[0].shape[0]
        jobs = check_jobs(pool, jobs, num_slots=num_slots)
        for job in jobs:
            self._check_tokens(job.prompt, "prompt")
        last_logits: list[torch.Tensor] = []
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (page ids, rows within page) per request
        slots: list[int] = []  # each request's own slot, then each snapshot's
        kv_parts: dict[int, list[Pair]] = {}
        state_parts: dict[int, list[Pair]] = {}  # per layer, in the order of `slots`
        taken: list[tuple[int, dict[int, Pair]]] = []  # (snapshot slot, state)
        for job in jobs:
            logits, kv, states, snapshot = self._compute(job, self._past(pool, job))
            last_logits.append(logits)
            positions = torch.arange(job.cached, len(job.prompt))  # never a cached (shared) page's rows
            rows.append(
                (pool.page_ids(job.request_id).cpu()[positions // pool.page_size], positions % pool.page_size)
            )
            slots.append(pool.slot_id(job.request_id))
            for layer, pair in kv.items():
                kv_parts.setdefault(layer, []).append(pair)
            for layer, state in states.items():
                state_parts.setdefault(layer, []).append(state)
            if job.snapshot is not None and snapshot is not None:  # (one exactly when the other)
                taken.append((job.snapshot[1], snapshot))
        for slot, snapshot in taken:
            slots.append(slot)
            for layer, state in snapshot.items():
                state_parts[layer].append(state)
        if not last_logits:
            return []
        firsts = pick_tokens(torch.stack(last_logits), [job.pick for job in jobs])
        # One indexed write per layer and tensor for the whole batch.
        pages = torch.cat([p for p, _ in rows])
        offsets = torch.cat([r for _, r in rows])
        for layer, parts in kv_parts.items():
            for cache, part in zip(pool.kv_view(layer), zip(*parts, strict=True), strict=True):
                cache[pages.to(cache.device), offsets.to(cache.device)] = torch.cat(part).to(cache)
        slot_ids = torch.tensor(slots)
        for layer, parts in state_parts.items():
            for view, part in zip(pool.state_view(layer), zip(*parts, strict=True), strict=True):
                view[slot_ids.to(view.device)] = torch.stack(part).to(view)
        return prefilled(jobs, firsts)

    def decode_step(
        self,
        pool: Pool,
        request_ids: Sequence[str],
        last_tokens: Sequence[int],
        picks: Sequence[TokenPick | None] | None = None,
    ) -> list[int]:
        """One token for each request, batched, picked as `picks` says (None: greedy).

        Each request must have been prefilled and then extended by one token (`pool.extend(rid, 1)`)
        for the token being fed (`last_tokens`); its K/V lands in that new position.
        """
        job = plan_decode(pool, request_ids, last_tokens, self.vocab_size)
        if job is None:
            return []
        page_size, table, num_tokens = pool.page_size, job.page_table, job.num_tokens
        max_pages = table.shape[1]
        positions = job.positions
        new_pages = table[torch.arange(len(request_ids)), positions // page_size]
        new_rows = positions % page_size
        valid = torch.arange(max_pages * page_size)[None] < num_tokens[:, None]  # (B, S)
        valid = valid.to(self.device)
        slots = torch.tensor([pool.slot_id(r) for r in request_ids])

        x = self.embedding[torch.tensor(list(last_tokens), device=self.device)]  # (B, hidden)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, 1.0, self.eps)
            if isinstance(layer, AttentionLayer):
                q, k, v = layer.qkv(h)
                k_cache, v_cache = pool.kv_view(i)  # (num_pages, page_size, kv_heads, head_dim) each
                where = (new_pages.to(k_cache.device), new_rows.to(k_cache.device))
                k_cache[where] = k.to(k_cache)
                v_cache[where] = v.to(v_cache)
                index = table.to(k_cache.device)
                # (B, S = max_pages * page_size, kv_heads, head_dim)
                keys = k_cache[index].flatten(1, 2).to(self.device, COMPUTE_DTYPE)
                values = v_cache[index].flatten(1, 2).to(self.device, COMPUTE_DTYPE)
                out = layer.attend(q[:, None], keys, values, valid[:, None])[:, 0]
            elif isinstance(layer, Mamba2Layer):
                conv_view, ssm_view = pool.state_view(i)
                index = slots.to(conv_view.device)
                conv = conv_view[index].to(self.device, COMPUTE_DTYPE)
                ssm = ssm_view[index].to(self.device, COMPUTE_DTYPE)
                out, conv, ssm = layer.forward_step(h, conv, ssm)
                conv_view[index] = conv.to(conv_view)
                ssm_view[index] = ssm.to(ssm_view)
            else:
                out = layer(h)
            x = x + out
        return pick_tokens(self._logits(x), picks)

    def admit(self, pool: Pool, request_id: str, prompt: Sequence[int], first_token: int) -> Mismatch | None:
        return None

    def check(self, pool: Pool, request_id: str) -> Mismatch | None:
        return None

    def forget(self, request_id: str) -> None:
        return None
