"""One batched decode step, checked once for every model: which requests, how long each is, and the
page table their attention reads.

Each request was prefilled and then extended by one token (`pool.extend(request_id, 1)`) for the
token it is fed, so it holds `num_tokens` tokens and that token's K/V lands at position
`num_tokens - 1`. The page table pads every row to the longest request with the request's own first
page: padded keys are masked by length, and every id stays a valid page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distpool.memory.pool import Pool
from distpool.model_impl.errors import DUPLICATE_REQUEST, NOT_EXTENDED, BatchRefused, TokenIdsOutOfRange


def check_token_ids(tokens: Sequence[int], vocab_size: int, what: str) -> None:
    """TokenIdsOutOfRange unless every id in `tokens` is in [0, vocab_size)."""
    if any(not 0 <= t < vocab_size for t in tokens):
        raise TokenIdsOutOfRange(what, tuple(tokens), vocab_size)


@dataclass(frozen=True)
class DecodeJob:
    """The requests of one decode step, as their pool holds them."""

    num_tokens: torch.Tensor  # (B,) int64: tokens each request holds, the one fed now included
    page_table: torch.Tensor  # (B, max_pages) int64 physical page ids, padded as the module says

    @property
    def positions(self) -> torch.Tensor:
        """(B,) the position of the token each request is fed."""
        return self.num_tokens - 1


def plan_decode(
    pool: Pool, request_ids: Sequence[str], last_tokens: Sequence[int], vocab_size: int
) -> DecodeJob | None:
    """The job of `decode_step(pool, request_ids, last_tokens)` (None for an empty batch); refuses a
    batch it cannot run with `BatchRefused` (or ValueError for a malformed call)."""
    if len(request_ids) != len(last_tokens):
        raise ValueError(f"{len(request_ids)} request ids for {len(last_tokens)} last tokens")
    if len(set(request_ids)) != len(request_ids):
        ids = list(request_ids)
        raise BatchRefused(DUPLICATE_REQUEST, None, f"a decode batch names a request twice: {ids}", ids)
    if not request_ids:
        return None
    check_token_ids(last_tokens, vocab_size, "last_tokens")
    num_tokens = torch.tensor([pool.num_tokens(r) for r in request_ids])
    if bool((num_tokens < 2).any()):
        raise BatchRefused(
            NOT_EXTENDED,
            None,
            f"decode_step needs prefilled requests extended by one token; {list(request_ids)} hold"
            f" {num_tokens.tolist()} tokens",
            num_tokens.tolist(),
            2,
        )
    tables = [pool.page_ids(r).cpu() for r in request_ids]
    lengths = [t.shape[0] for t in tables]  # (ints: len() of a tensor costs a call into torch)
    for request_id, n_pages, n in zip(request_ids, lengths, num_tokens.tolist(), strict=True):
        if n_pages * pool.page_size < n:
            raise ValueError(
                f"request {request_id!r} holds {n} tokens in {n_pages} pages of {pool.page_size}"
            )
    width = max(lengths)
    if any(n < width for n in lengths):
        tables = [torch.cat([t, t[:1].expand(width - n)]) for t, n in zip(tables, lengths, strict=True)]
    page_table = torch.stack(tables)
    return DecodeJob(num_tokens=num_tokens, page_table=page_table)
