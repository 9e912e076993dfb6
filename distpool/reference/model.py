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

from distpool.model.spec import HYBRID_MAMBA, ModelSpec
from distpool.reference.configs import REFERENCE_HYBRID_CONFIG
from distpool.reference.layers import (
    COMPUTE_DTYPE,
    AttentionLayer,
    Mamba2Layer,
    WeightFactory,
    build_layers,
    rms_norm,
)
from distpool.reference.pool_model import Mismatch, PoolModel

if TYPE_CHECKING:
    from distpool.memory.pool import Pool

_LOGIT_STD = 4.0  # wide logits keep greedy argmax far from ties between equivalent computations
MAX_PARAMS = 64_000_000


def approx_params(spec: ModelSpec) -> int:
    """Embeddings, head, and ~12 h^2 per layer: enough to tell a toy from a real checkpoint."""
    return 2 * spec.vocab_size * spec.hidden_size + 12 * spec.num_layers * spec.hidden_size**2


def unsupported_reason(spec: ModelSpec) -> str | None:
    """Why the reference model cannot run `spec` (with the fix), or None when it can. From the spec alone."""
    name = ", ".join(spec.architectures) or spec.model_type or spec.source
    if (
        spec.kind != HYBRID_MAMBA
        or spec.mamba is None
        or spec.mamba.family != "mamba2"
        or (spec.sliding_window_layers or set(spec.full_attention_layers) & set(spec.mamba_layers))
    ):
        return (
            f"the reference model runs hybrid Mamba2 models only (attention and Mamba2 in separate layers); "
            f"{spec.source} ({name}) is {spec.kind}"
            + (f" with {spec.mamba.family} state" if spec.mamba is not None else "")
            + f". Fix: use {REFERENCE_HYBRID_CONFIG} or another Mamba2 hybrid config"
        )
    attention = spec.full_attention
    assert attention is not None
    dims = {
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "num_attention_heads": spec.num_attention_heads,
        "intermediate_size": spec.intermediate_size,
    }
    if missing := [k for k, v in dims.items() if v <= 0]:
        return f"{spec.source} does not state {', '.join(missing)}, which the reference model needs"
    if spec.num_attention_heads % attention.num_kv_heads or attention.v_head_dim != attention.head_dim:
        return f"{spec.source}: attention heads must group over KV heads, with V as wide as K"
    if approx_params(spec) > MAX_PARAMS:
        return (
            f"{spec.source} describes a model of about {approx_params(spec) / 1e6:.0f} M parameters; the "
            "reference model builds random weights for small configs only "
            f"(at most {MAX_PARAMS / 1e6:.0f} M). "
            f"Fix: use {REFERENCE_HYBRID_CONFIG} or shrink hidden_size / vocab_size / layers"
        )
    return None


class ReferenceModel(PoolModel):
    """Greedy Nemotron-H style hybrid (Mamba2, attention, MLP layers) with seeded weights.

    Built from a `ModelSpec` alone: full-attention layers are GQA attention, Mamba layers Mamba2,
    every other layer a relu^2 MLP. Weights depend only on the spec's dimensions and `seed`, whatever
    the device. Raises ValueError (with the fix) for specs `unsupported_reason` refuses.
    It keeps no record of requests, so `admit` and `check` have nothing to verify.
    """

    name = "reference"
    verifies = False

    def __init__(self, spec: ModelSpec, *, seed: int = 0, device: str | torch.device = "cpu") -> None:
        if (reason := unsupported_reason(spec)) is not None:
            raise ValueError(reason)
        assert spec.full_attention is not None and spec.mamba is not None
        self.spec = spec
        self.seed = seed
        self.device = torch.device(device)
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size
        self.eps = spec.norm_eps
        weights = WeightFactory(seed, self.device)  # draw order: embedding, layers, lm_head
        self.embedding = weights.normal(self.vocab_size, self.hidden_size, std=1.0)
        self.layers = build_layers(spec, weights)
        self.lm_head = weights.normal(
            self.hidden_size, self.vocab_size, std=_LOGIT_STD * self.hidden_size**-0.5
        )

    # ---- forward passes ------------------------------------------------------------------
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0, self.eps) @ self.lm_head

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise ValueError(f"{what} has token ids outside [0, {self.vocab_size}): {list(tokens)}")

    def _forward_sequence(
        self, tokens: Sequence[int]
    ) -> tuple[
        torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]], dict[int, tuple[torch.Tensor, ...]]
    ]:
        """The whole sequence from empty cache -> last-token logits (vocab,), K/V per attention
        layer ((T, kv_heads, head_dim) each), final (conv, ssm) state per Mamba layer."""
        if len(tokens) == 0:
            raise ValueError("a prompt needs at least one token")
        self._check_tokens(tokens, "prompt")
        x = self.embedding[torch.tensor(list(tokens), device=self.device)]  # (T, hidden)
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        states: dict[int, tuple[torch.Tensor, ...]] = {}
        causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=self.device).tril()
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, 1.0, self.eps)
            if isinstance(layer, AttentionLayer):
                q, k, v = layer.qkv(h)
                kv[i] = (k, v)
                out = layer.attend(q[None], k[None], v[None], causal[None])[0]
            elif isinstance(layer, Mamba2Layer):
                out, conv_state, ssm_state = layer.forward_sequence(h)
                states[i] = (conv_state, ssm_state)
            else:
                out = layer(h)
            x = x + out
        return self._logits(x[-1]), kv, states

    def generate_nocache(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """The oracle: full recompute from zero state for every new token, no cache at all."""
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            logits, _, _ = self._forward_sequence(tokens)
            tokens.append(int(logits.argmax()))
        return tokens[len(prompt) :]

    # ---- cached passes through a pool ---------------------------------------------------------
    def prefill(self, pool: Pool, request_ids: Sequence[str], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Run each prompt, write its K/V into its pages and its final state into its slot.

        Each request must already be reserved with exactly `len(prompt)` tokens. Returns the first
        generated token per request (greedy).
        """
        if len(request_ids) != len(prompts):
            raise ValueError(f"{len(request_ids)} request ids for {len(prompts)} prompts")
        firsts: list[int] = []
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (page ids, rows within page) per request
        slots: list[int] = []
        kv_parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        state_parts: dict[int, list[tuple[torch.Tensor, ...]]] = {}
        for request_id, prompt in zip(request_ids, prompts, strict=True):
            if pool.num_tokens(request_id) != len(prompt):
                raise ValueError(
                    f"request {request_id!r} holds {pool.num_tokens(request_id)} tokens in the pool but its "
                    f"prompt has {len(prompt)}. Fix: reserve it with len(prompt) tokens before prefill"
                )
            logits, kv, states = self._forward_sequence(prompt)
            firsts.append(int(logits.argmax()))
            positions = torch.arange(len(prompt))
            rows.append(
                (pool.page_ids(request_id).cpu()[positions // pool.page_size], positions % pool.page_size)
            )
            slots.append(pool.slot_id(request_id))
            for layer, pair in kv.items():
                kv_parts.setdefault(layer, []).append(pair)
            for layer, state in states.items():
                state_parts.setdefault(layer, []).append(state)
        if not firsts:
            return firsts
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
        return firsts

    def decode_step(self, pool: Pool, request_ids: Sequence[str], last_tokens: Sequence[int]) -> list[int]:
        """One greedy token for each request, batched.

        Each request must have been prefilled and then extended by one token (`pool.extend(rid, 1)`)
        for the token being fed (`last_tokens`); its K/V lands in that new position.
        """
        if len(request_ids) != len(last_tokens):
            raise ValueError(f"{len(request_ids)} request ids for {len(last_tokens)} last tokens")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"a decode batch names a request twice: {list(request_ids)}")
        if not request_ids:
            return []
        self._check_tokens(last_tokens, "last_tokens")
        page_size = pool.page_size
        num_tokens = torch.tensor([pool.num_tokens(r) for r in request_ids])
        if bool((num_tokens < 2).any()):
            raise ValueError(
                f"decode_step needs prefilled requests extended by one token; {list(request_ids)} hold"
                f" {num_tokens.tolist()} tokens. Fix: prefill, then pool.extend(request_id, 1) before a step"
            )
        tables = [pool.page_ids(r).cpu() for r in request_ids]
        assert all(len(t) * page_size >= n for t, n in zip(tables, num_tokens.tolist(), strict=True)), (
            "pool gave too few pages"
        )
        max_pages = max(len(t) for t in tables)
        # (B, max_pages), padded with each request's own first page: padded keys are masked and
        # the page id stays in range.
        table = torch.stack([torch.cat([t, t[:1].expand(max_pages - len(t))]) for t in tables])
        positions = num_tokens - 1
        new_pages = table[torch.arange(len(tables)), positions // page_size]
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
        return self._logits(x).argmax(dim=-1).tolist()

    def admit(self, pool: Pool, request_id: str, prompt: Sequence[int], first_token: int) -> Mismatch | None:
        return None

    def check(self, pool: Pool, request_id: str) -> Mismatch | None:
        return None

    def forget(self, request_id: str) -> None:
        return None
