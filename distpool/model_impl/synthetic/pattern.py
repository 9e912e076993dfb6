"""The synthetic cache's byte pattern: pure functions of (seed, layer, tensor, tokens).

Every value is defined on raw bytes, so it holds for any dtype (bf16, fp8, fp32 state). A row (one
token's K or V in one layer, or one whole state tensor) is read as words: int64 when its byte count is
a multiple of 8, bytes otherwise. Byte `e` of a row is `base[e] ^ hash_byte[e % 8]`, where `hash_byte`
are the little-endian bytes of a 64-bit hash; with int64 words that is one XOR per word, so both word
kinds give the same bytes. `e` is the byte's offset in the unsharded row, so a tensor-parallel rank's
shard holds the bytes the unsharded tensor holds there (`row_map.py`). Prefix hashes, keys and hashes
are numpy uint64 (arithmetic wraps mod 2^64).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

HASH_BASE = 0x100000001B3  # odd, so invertible mod 2^64: prefix hashes are computed without a loop
MASK = (1 << 64) - 1
TOKEN_KEY = 0x70CE_5EED_0F_70CE  # separates generated tokens from every byte stream
BASE_KEY = 0xBA5E_0F_B17E5  # separates a stream's per-word base from its per-row hashes
NUM_STRIPES = 16  # a decode step rewrites one stripe of each state tensor (see model.py)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on every element of a uint64 array."""
    z = x.astype(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def mix_one(value: int) -> int:
    """splitmix64 of one value, as a Python int in [0, 2^64)."""
    return int(splitmix64(np.array([value & MASK], dtype=np.uint64))[0])


def prefix_hashes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """(n + 1,) uint64: H_0 = 0 and H_k = H_{k-1} * B + (t_{k-1} + 1), vectorised.

    H_k = B^(k-1) * sum_{i<k} (t_i + 1) * B^-i, all mod 2^64 (B is odd, so B^-1 exists).
    """
    values = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
    n = len(values)
    out = np.zeros(n + 1, dtype=np.uint64)
    if n == 0:
        return out
    powers = np.full(n, HASH_BASE, dtype=np.uint64)
    powers[0] = 1
    inverse = np.full(n, pow(HASH_BASE, -1, 1 << 64), dtype=np.uint64)
    inverse[0] = 1
    weighted = np.cumsum(values * np.cumprod(inverse), dtype=np.uint64)
    out[1:] = np.cumprod(powers) * weighted
    return out


def next_hash(prefix_hash: int, token: int) -> int:
    """H_{n+1} from H_n and token t_n: the one-token step of `prefix_hashes`."""
    return (prefix_hash * HASH_BASE + token + 1) & MASK


def stream_key(seed: int, layer: int, what: str) -> int:
    """The key of one byte stream: (seed, layer, what), what in k, v, swa_k, swa_v, state.<name>."""
    name = int.from_bytes(hashlib.blake2b(what.encode(), digest_size=8).digest(), "little")
    return mix_one(mix_one(seed) ^ mix_one(layer) ^ name)


def row_hashes(key: int, hashes: np.ndarray) -> np.ndarray:
    """The 64-bit hash each row XORs onto its base: one per prefix hash."""
    return splitmix64(hashes ^ np.uint64(key))


def token_after(seed: int, prefix_hash: int, vocab_size: int) -> int:
    """The token generated after the prefix whose hash is `prefix_hash`."""
    return mix_one(prefix_hash ^ TOKEN_KEY ^ mix_one(seed)) % vocab_size


def word_dtype(num_bytes: int) -> torch.dtype:
    """int64 words when a row is whole words, else bytes (the pattern's bytes are the same)."""
    return torch.int64 if num_bytes % 8 == 0 else torch.uint8


def state_rows(view: torch.Tensor) -> torch.Tensor:
    """A state view (num_slots, rows, *rest) as (num_slots, rows, row bytes) raw bytes, sharing
    storage. A slot keeps each state tensor's rows apart (layers interleave them, `SLOT_ORDER`), so
    a slot's tensor is read (`read_state`) and written (`write_state_bytes`) row-wise, not as one run.

    Every dim after the rows must be contiguous (the pool's views are); raises rather than copies.
    """
    raw = view.unsqueeze(-1).view(torch.uint8)  # (num_slots, rows, *rest, item): the last dim contiguous
    rows = raw.view(*raw.shape[:2], -1)
    if rows.untyped_storage().data_ptr() != view.untyped_storage().data_ptr():
        raise ValueError(f"a state view of shape {tuple(view.shape)} has rows that are not contiguous")
    return rows


def read_state(rows: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """Slot `slot`'s tensor of `rows` (`state_rows`) as flat words of `dtype`: a copy."""
    return rows[slot].reshape(-1).view(dtype)


def write_state_bytes(rows: torch.Tensor, slot: int, start: int, data: torch.Tensor) -> None:
    """Write 1-D `data` (any dtype) over slot `slot`'s tensor of `rows` from flat byte `start`: the
    part of a first and of a last row, and the whole rows between, with three copies at most."""
    raw, width = data.view(torch.uint8), rows.shape[2]
    target, stop, at = rows[slot], start + raw.numel(), 0
    first, last = -(-start // width), stop // width  # whole rows [first, last)
    if first > last:  # within one row
        row, column = divmod(start, width)
        target[row, column : column + raw.numel()] = raw
        return
    if start < first * width:
        at = first * width - start
        target[first - 1, width - at :] = raw[:at]
    if first < last:
        target[first:last] = raw[at : at + (last - first) * width].view(last - first, width)
        at += (last - first) * width
    if at < raw.numel():
        target[last, : raw.numel() - at] = raw[at:]


def as_units(view: torch.Tensor) -> torch.Tensor:
    """`view` (..., dim) with its last dim read as raw units, sharing storage: int64 where the dim
    is whole words, else bytes. A KV view's rows span heads that lie apart in a page (heads are
    outermost there), so its rows are read and written per head's units (`unit_rows`,
    `put_unit_rows`), not as one run of words."""
    raw = view.view(torch.uint8)  # the last dim is contiguous
    return raw.view(word_dtype(raw.shape[-1]))


def unit_rows(units: torch.Tensor, where: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """The rows of `units` (`as_units`) at `where`, as (n, words) of `dtype`: a copy."""
    picked = units[where]  # (n, *rest), contiguous
    return picked.view(torch.uint8).reshape(picked.shape[0], -1).view(dtype)


def put_unit_rows(units: torch.Tensor, where: tuple[torch.Tensor, ...], rows: torch.Tensor) -> None:
    """Write (n, words) `rows` (any word dtype) over the rows of `units` at `where`."""
    units[where] = rows.view(torch.uint8).view(units.dtype).view(rows.shape[0], *units.shape[2:])


def spread(hashes: np.ndarray, phases: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Row hashes laid over words of their rows: (n, 1) int64 for int64 words (`phases` None), or
    (n, len(phases)) bytes, byte e taking byte `phases[e]` (its unsharded offset % 8) of its hash.
    Broadcasts against (n, words)."""
    signed = torch.from_numpy(hashes.astype(np.uint64).view(np.int64)).to(device)
    if phases is None:
        return signed[:, None]
    return signed.view(torch.uint8).view(-1, 8)[:, phases]


def stripe_bounds(num_words: int) -> list[tuple[int, int]]:
    """Word ranges [s*L, (s+1)*L), L = ceil(W / stripes), of the min(16, W) stripes of a W-word
    tensor (W >= 1); the last ones may be empty when W is not a multiple of the stripe count."""
    count = min(NUM_STRIPES, num_words)
    length = -(-num_words // count)
    return [(min(s * length, num_words), min((s + 1) * length, num_words)) for s in range(count)]


def stripe_writers(prompt_len: int, num_tokens: int, num_stripes: int) -> list[int]:
    """Per stripe, the token count whose step last wrote it: prefill (at `prompt_len`) wrote every
    stripe, then the step reaching m tokens wrote stripe m % num_stripes."""
    writers = []
    for stripe in range(num_stripes):
        latest = num_tokens - (num_tokens - stripe) % num_stripes
        writers.append(latest if latest > prompt_len else prompt_len)
    return writers
