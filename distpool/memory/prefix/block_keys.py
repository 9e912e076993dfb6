"""The one key of a cached prefix, shared by decode's prefix index, its final states and the driver.

A prefix of tokens is keyed block by block (a block is one page: `page_size` tokens), each key
chained on the one before it:

    key(no tokens)                 = ROOT_KEY
    key(tokens[: (i + 1) * block]) = blake2b(key(tokens[: i * block]) || block i's tokens)

with tokens packed as int64 little-endian and every key KEY_BYTES wide. A partial last block chains
the same way (`prefix_key`), so any token sequence has a key, and a whole number of blocks has the
key its last block has in the chain. (Fixed-width key, tokens of fixed width) encodes a prefix
injectively: two prefixes share a key only through a blake2b-128 collision, about n**2 / 2**129 for
n keys. Decode compares tokens before it uses an entry; the driver, which holds keys alone, can at
worst be refused once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16
TOKEN_BYTES = 8  # tokens are packed as int64 little-endian
ROOT_KEY = hashlib.blake2b(b"distpool.prefix", digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, block: bytes) -> bytes:
    """The key of a block (its tokens packed, `pack`) after the prefix keyed `parent`."""
    return hashlib.blake2b(parent + block, digest_size=KEY_BYTES).digest()


def pack(tokens: Tokens) -> bytes:
    """Token ids as int64 little-endian bytes: what a key hashes."""
    return np.asarray(tokens, dtype="<i8").tobytes()


Tokens = Sequence[int] | np.ndarray  # token ids, 1-D


def chained_block_keys(tokens: Tokens, block: int, limit: int | None = None) -> list[bytes]:
    """Key i is the key of the prefix through full block i (at most `limit` blocks are keyed)."""
    count = len(tokens) // block if limit is None else min(len(tokens) // block, limit)
    data, step = pack(tokens[: count * block]), TOKEN_BYTES * block
    keys: list[bytes] = []
    key = ROOT_KEY
    for start in range(0, count * step, step):
        key = block_key(key, data[start : start + step])
        keys.append(key)
    return keys


@dataclass(frozen=True, slots=True)
class StateKey:
    """What identifies a kept final state: the state after exactly `num_tokens` tokens."""

    num_tokens: int
    blocks_key: bytes  # the key of its full blocks (ROOT_KEY: it has none)
    key: bytes  # the key of all its tokens: `blocks_key` chained with its partial block, if any

    @classmethod
    def of(cls, tokens: Sequence[int], block: int) -> StateKey:
        chain = chained_block_keys(tokens, block)
        blocks_key = chain[-1] if chain else ROOT_KEY
        return cls(num_tokens=len(tokens), blocks_key=blocks_key, key=tail_key(blocks_key, tokens, block))


def tail_key(blocks_key: bytes, tokens: Sequence[int], block: int) -> bytes:
    """The key of `tokens` given `blocks_key`, the key of their full blocks."""
    tail = len(tokens) % block
    return block_key(blocks_key, pack(tokens[len(tokens) - tail :])) if tail else blocks_key


def prefix_key(tokens: Sequence[int], block: int) -> bytes:
    """The key of a whole token sequence, a partial last block included."""
    return StateKey.of(tokens, block).key
