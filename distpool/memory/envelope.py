"""The request envelope: one request's bytes in a pool, as a transfer moves them.

An `Envelope` is what one side of a transfer knows of a request, built once by `Pool.envelope`:

    request_id, num_tokens
    ranges      (n, 2) int64 (offset, nbytes) rows in the arena, canonical order: the slot (if
                has_slot), then each page in token order, then each sliding-window page
    held_pages  (destination) its first pages hold a prefix cached here already: shared, read only
    moving      the rows a transfer moves: `ranges` less the held pages (the slot row stays first)

Two pools with the same layout fingerprint list the same rows with the same sizes, so row i of one
side pairs with row i of the other. Nothing else about pool memory crosses: the layout fingerprint
is compared once per channel at its handshake, and a transfer's header carries the source's
`ranges` as raw bytes (transfer/wire/protocol.py), which the receiver checks against its own envelope
before anything is written. Physical ids never leave the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from distpool.memory.errors import EnvelopeInvalid, HeldPagesInvalid, RequestIdInvalid

Table = TypeVar("Table", torch.Tensor, np.ndarray)  # (n, 2) int64 rows: (offset, nbytes)

# The most pages a transfer's header may describe (~16M tokens at page_size 16, far past any
# context length), and the longest request id an envelope carries.
MAX_PAGES = 1 << 20
MAX_REQUEST_ID_CHARS = 256


def moving_rows(table: Table, held_pages: int, *, has_slot: bool) -> Table:
    """The rows of an envelope's table that a transfer moves: all but its first `held_pages` pages,
    which the destination holds already (a prefix it cached). The slot row stays first.

    Both ends drop the same rows (the receiver says how many in READY), so row i still pairs with
    row i. Raises HeldPagesInvalid when the table has fewer pages than that (or the count is negative)."""
    first = int(has_slot)
    if not 0 <= held_pages <= table.shape[0] - first:
        raise HeldPagesInvalid(held_pages, table.shape[0] - first)
    if held_pages == 0:
        return table
    return table[[*range(first), *range(first + held_pages, table.shape[0])]]


@dataclass(frozen=True, eq=False)
class Envelope:
    """Everything one request owns in a pool, as byte ranges of its arena (see the module doc).
    Raises EnvelopeInvalid (RequestIdInvalid for the id) or HeldPagesInvalid for fields that cannot
    describe one; `moving` is computed here, once."""

    request_id: str
    num_tokens: int
    ranges: torch.Tensor  # (n, 2) int64 on the host, canonical order
    has_slot: bool
    held_pages: int = 0
    moving: torch.Tensor = field(init=False, repr=False)  # `ranges` less the held pages

    def __post_init__(self) -> None:
        if type(self.request_id) is not str or not 0 < len(self.request_id) <= MAX_REQUEST_ID_CHARS:
            raise RequestIdInvalid(self.request_id, MAX_REQUEST_ID_CHARS)
        if type(self.num_tokens) is not int or self.num_tokens < 0:
            raise EnvelopeInvalid("num_tokens", self.num_tokens, "an int >= 0")
        ranges = self.ranges
        if ranges.dtype != torch.int64 or ranges.dim() != 2 or ranges.shape[1] != 2:
            shape = f"{tuple(ranges.shape)} {ranges.dtype}"
            raise EnvelopeInvalid("ranges", shape, "an (n, 2) int64 tensor of (offset, nbytes)")
        if ranges.device.type != "cpu":
            raise EnvelopeInvalid(
                "ranges", f"a {ranges.device.type} tensor", "a CPU tensor (a transfer plans on the host)"
            )
        if ranges.shape[0] == 0:
            raise EnvelopeInvalid("ranges", "no rows", "at least one byte range")
        object.__setattr__(self, "moving", moving_rows(ranges, self.held_pages, has_slot=self.has_slot))

    @property
    def num_bytes(self) -> int:
        """The bytes a transfer moves: the whole envelope less its held pages."""
        return int(self.moving[:, 1].sum())

    def moving_of(self, table: Table) -> Table:
        """A peer's table of the same request (canonical order), less the pages held here: the rows
        that pair with `moving`."""
        return moving_rows(table, self.held_pages, has_slot=self.has_slot)
