"""Picking a token from logits (`pick_tokens`), the one place every model implementation samples.

Per request and token, in float64 on the CPU: banned ids (`TokenPick.banned`) get -inf; greedy
(temperature 0) is the argmax; else the logits are divided by the temperature, cut to the top k, then
to the top p of probability, and one uniform draw picks a token by inverse CDF over the kept tokens'
probabilities (in id order when nothing is cut, likeliest first otherwise). Nothing sorts the whole
vocabulary: top-k and top-p take partial top-k's.

The draw of token i comes from a fresh `torch.Generator` seeded with a hash of (the request's seed,
i): no generator state lives anywhere between tokens, so whichever process computes token i (prefill
or decode, a retried transfer's second prefill, a decode worker's local prefill, any rank of a TP
group) draws the same number, once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from distpool.model.sampling import MAX_SEED, TokenPick


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of token `index` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def uniform_draw(seed: int, index: int) -> float:
    """The one uniform number in [0, 1) that token `index` is picked with."""
    generator = torch.Generator(device="cpu").manual_seed(draw_seed(seed, index))
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def pick_tokens(logits: torch.Tensor, picks: Sequence[TokenPick | None] | None) -> list[int]:
    """One token per row of `logits` (B, vocab); `picks[b]` None (or `picks` None): greedy, nothing
    banned. The rows that need nothing but the argmax take it on the logits' own device and dtype."""
    if picks is None or all(p is None or (p.params.greedy and not p.banned) for p in picks):
        return logits.argmax(dim=-1).tolist()
    if len(picks) != logits.shape[0]:
        raise ValueError(f"{len(picks)} picks for {logits.shape[0]} rows of logits")
    rows = logits.detach().to("cpu", torch.float64)
    return [int(rows[b].argmax()) if p is None else pick_one(rows[b], p) for b, p in enumerate(picks)]


def pick_one(logits: torch.Tensor, pick: TokenPick) -> int:
    """Token `pick.index` of a request from its logits (vocab,), in float64."""
    logits = logits.to(torch.float64)
    if pick.banned:
        logits = logits.clone()
        logits[torch.tensor([t for t in pick.banned if t < logits.shape[0]], dtype=torch.long)] = -torch.inf
    params = pick.params
    if params.greedy:
        return int(logits.argmax())
    if params.seed is None:
        raise ValueError("a sampled (temperature > 0) request needs its seed set where it enters")
    logits = logits / params.temperature
    ids: torch.Tensor | None = None  # the kept tokens' ids; None: every token, in id order
    if 0 < params.top_k < logits.shape[0]:
        logits, ids = torch.topk(logits, params.top_k)  # likeliest first
    probs = torch.softmax(logits, dim=0)
    if params.top_p < 1:
        probs, kept = _nucleus(probs, params.top_p)
        ids = kept if ids is None else ids[kept]
    cdf = torch.cumsum(probs, dim=0)
    u = torch.tensor([uniform_draw(params.seed, pick.index) * float(cdf[-1])], dtype=torch.float64)
    chosen = min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)
    return chosen if ids is None else int(ids[chosen])


NUCLEUS_FIRST_K = 64  # the likeliest tokens looked at first for top-p; four times more until enough


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of the likeliest tokens whose probability reaches `top_p` (always one), as
    (probabilities, positions in `probs`), likeliest first. A partial top-k, widened until it holds
    `top_p`, instead of sorting the whole vocabulary: the nucleus is usually small."""
    k = min(NUCLEUS_FIRST_K, probs.shape[0])
    while True:
        values, positions = torch.topk(probs, k)
        if float(values.sum()) >= top_p or k == probs.shape[0]:
            break
        k = min(4 * k, probs.shape[0])
    before = torch.cumsum(values, dim=0) - values  # probability of the tokens ranked above each
    keep = max(1, int((before < top_p).sum()))
    return values[:keep], positions[:keep]
