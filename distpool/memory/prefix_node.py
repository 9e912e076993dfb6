"""A node of the prefix index's trie, and the chained digest that keys it in its parent's `children`
(the trie's picture, and why least recently used leaves go first: prefix_index.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

DIGEST_BYTES = 16
TOKEN_BYTES = 8  # tokens are packed as int64 little-endian
ROOT_DIGEST = hashlib.blake2b(b"distpool.prefix_index", digest_size=DIGEST_BYTES).digest()


def page_digest(parent_digest: bytes, page: bytes) -> bytes:
    """Digest of a page (its tokens packed as int64 LE) after its parent's. (fixed-size digest, fixed
    token count) encodes a whole prefix injectively, so two prefixes share a digest only through a
    blake2b-128 collision: about n**2 / 2**129 for n cached pages. Matches compare tokens anyway."""
    return hashlib.blake2b(parent_digest + page, digest_size=DIGEST_BYTES).digest()


@dataclass(eq=False, slots=True)
class PrefixNode:
    """One cached full page: where it sits in the trie, who uses it and when last, its checkpoint."""

    digest: bytes
    tokens: bytes  # the page's tokens, packed as int64 LE
    page: int
    parent: PrefixNode | None  # None only for the root; an evicted node is gone from parent.children
    depth: int
    children: dict[bytes, PrefixNode] = field(default_factory=dict)  # child digest -> child
    users: int = 0
    child_users: int = 0  # sum of the children's users: users - child_users requests end here
    tick: int = 0
    checkpoint: int | None = None

    def idle(self, *, leaf: bool, tick: int | None = None) -> bool:
        """Cached, no users, a leaf (or holding a checkpoint), and last used at `tick` if given."""
        wanted = not self.children if leaf else self.checkpoint is not None
        cached = self.parent is not None and self.parent.children.get(self.digest) is self
        return wanted and self.users == 0 and cached and tick in (None, self.tick)
