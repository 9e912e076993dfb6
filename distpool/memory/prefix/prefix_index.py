"""Prefix index: which full KV pages and state checkpoints are cached, keyed by their token content.

Pure bookkeeping over opaque int handles from the allocator (virtual page ids, virtual slot ids): it
never allocates, frees or touches bytes. A trie of full pages (here page_size = 4):

    root ── [a b c d] ── [e f g h] ── [i j k l]*        * = holds a checkpoint: a copy of the recurrent
                 └────── [e f x y]*                       state after exactly its page's last token

A node stands for the first depth * page_size tokens, keyed by the prefix's chained block key
(`block_keys.py`: the key the driver and decode's final states use too), and keeps its tokens: a
collision can only lose a hit, never mis-match. A `CacheJournal`, when set, hears of every node
cached and evicted (what decode reports to the driver).
A request holding page k through the cache holds pages 0..k-1 too (`users`), so idle nodes (no users)
form whole subtrees, all evictable leaves first. acquire, release and insert stamp their path with one
new tick (match is read-only): no node is used after its parent, so least-recently-used leaf first is
least-recently-used first (ties: deeper first). Heaps of idle leaves / checkpoints skip stale entries.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from distpool.memory.errors import (
    CheckpointsRefused,
    HandlesReused,
    InvariantBroken,
    NotACachedPrefix,
    NotAcquired,
    PagesStillHeld,
    StaleMatch,
)
from distpool.memory.prefix.block_keys import ROOT_KEY, TOKEN_BYTES, block_key
from distpool.memory.prefix.cache_view import CacheJournal


@dataclass(eq=False, slots=True)
class PrefixNode:
    """One cached full page: where it sits in the trie, who uses it and when last, its checkpoint."""

    digest: bytes  # the chained block key of the prefix through this page
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


Tokens = Sequence[int] | np.ndarray  # token ids, 1-D
Checkpoints = dict[int, int] | None  # depth k (1-based) -> checkpoint handle


def require_or_raise(ok: bool, code: str, statement: str, subject: str = "") -> None:
    if not ok:
        raise InvariantBroken(code, f"prefix index: {statement}", subject)


@dataclass(frozen=True)
class PrefixMatch:
    """The usable cached prefix of a prompt: `pages` (handles, token order) cover `num_tokens` tokens,
    never the whole prompt. `checkpoint`: the handle at the last page (needs_checkpoint), else None."""

    pages: tuple[int, ...]
    num_tokens: int  # len(pages) * page_size
    checkpoint: int | None = None


@dataclass(frozen=True)
class Handles:
    """Handles that changed owner: adopted by `insert` (count a cache reference for each), or given
    back by `evict` / `drop_all` (drop that reference). Pages in path order, checkpoints by depth."""

    pages: tuple[int, ...] = ()
    checkpoints: tuple[int, ...] = ()


class PrefixIndex:
    """Cached full pages by token content, with state checkpoints, reference counts and LRU eviction.
    `needs_checkpoint=True` (hybrid Mamba): a prefix is usable only up to its deepest matched page with
    a checkpoint. False (attention-only, hybrid SWA): any matched depth is usable; no checkpoints."""

    def __init__(self, page_size: int, *, needs_checkpoint: bool) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1 token, got {page_size}")
        self.page_size = page_size
        self.needs_checkpoint = needs_checkpoint
        self.journal: CacheJournal | None = None  # hears of every page cached and evicted, when set
        self._reset()

    def _reset(self) -> None:
        self._root = PrefixNode(digest=ROOT_KEY, tokens=b"", page=-1, parent=None, depth=0)
        self._by_page: dict[int, PrefixNode] = {}
        self._by_checkpoint: dict[int, PrefixNode] = {}
        self._num_idle_pages = self._num_idle_checkpoints = 0
        self._clock = 0
        self._seq = itertools.count()  # heap tie-break: push order
        self._heaps: dict[bool, list] = {True: [], False: []}  # leaf? -> heap of (tick, seq, node)

    @property
    def num_pages(self) -> int:
        return len(self._by_page)

    @property
    def num_checkpoints(self) -> int:
        return len(self._by_checkpoint)

    def __len__(self) -> int:
        return len(self._by_page)

    def keys(self) -> frozenset[bytes]:
        """The chained block key of every cached page."""
        return frozenset(node.digest for node in self._by_page.values())

    def evictable(self) -> tuple[int, int]:
        """(pages, checkpoints) that `evict` could give back now: those with no users."""
        return self._num_idle_pages, self._num_idle_checkpoints

    def match(self, tokens: Tokens) -> PrefixMatch:
        """Longest usable cached prefix of `tokens`, at most len(tokens) - 1 tokens. Read-only:
        changes neither users nor ticks (`acquire` does both)."""
        num_tokens, pages = self._pages(tokens)
        path = self._walk(pages[: max(num_tokens - 1, 0) // self.page_size])
        while self.needs_checkpoint and path and path[-1].checkpoint is None:
            path.pop()
        checkpoint = path[-1].checkpoint if path and self.needs_checkpoint else None
        pages = tuple(node.page for node in path)
        return PrefixMatch(pages=pages, num_tokens=len(pages) * self.page_size, checkpoint=checkpoint)

    def cached_path(self, tokens: Tokens) -> tuple[int, ...]:
        """Handles of the cached pages along every full page of `tokens` (all of them may match,
        unlike `match`), checkpoints aside. Read-only."""
        return tuple(node.page for node in self._walk(self._pages(tokens)[1]))

    def branch_depth(self, tokens: Tokens) -> int:
        """Full pages of `tokens` (within len(tokens) - 1) cached where another cached prompt goes on
        past them: the boundary where this prompt leaves a cached path (0 if it leaves none, or only
        extends a cached prompt; all of them if every page is cached). Read-only."""
        num_tokens, pages = self._pages(tokens)
        limit = max(num_tokens - 1, 0) // self.page_size
        path = self._walk(pages[:limit])
        return len(path) if path and (len(path) == limit or path[-1].children) else 0

    def acquire(self, match: PrefixMatch) -> None:
        """A request starts using a match: users += 1 on each of its pages, which stamps them."""
        path = self._path_of(match.pages)
        if match.checkpoint != (path[-1].checkpoint if path and self.needs_checkpoint else None):
            raise StaleMatch(match)
        self._stamp(path, users=1)

    def release(self, pages: Sequence[int]) -> None:
        """A request stops using the pages it acquired (a match's `pages`): users -= 1, stamped."""
        path = self._path_of(pages)
        if path and path[-1].users == path[-1].child_users:  # then no request's pages end there
            raise NotAcquired(pages)
        self._stamp(path, users=-1)

    def insert(self, tokens: Tokens, pages: Sequence[int], *, checkpoints: Checkpoints = None) -> Handles:
        """Cache the full pages of `tokens` (page k's handle: pages[k]; a partial last page never is)
        and stamp their path; where a page's content is cached already, the caller keeps its handle.
        `checkpoints`: depth k in 1..full pages (state after k * page_size tokens) -> handle, adopted
        where that node holds none. Returns the adopted handles. Takes no users (that is `acquire`)."""
        checkpoints = checkpoints or {}
        full_pages = self._pages(tokens)[1]
        if len(pages) < len(full_pages):
            raise ValueError(f"{len(full_pages)} full pages of tokens but only {len(pages)} page handles")
        if checkpoints and not self.needs_checkpoint:
            raise CheckpointsRefused(sorted(checkpoints), len(full_pages), keeps_checkpoints=False)
        if any(not 1 <= depth <= len(full_pages) for depth in checkpoints):
            raise CheckpointsRefused(sorted(checkpoints), len(full_pages), keeps_checkpoints=True)
        path = self._walk(full_pages)
        parent, known = path[-1] if path else self._root, len(path)
        reach = len(full_pages)  # depth of the deepest page once inserted; a digest collision blocks the rest
        if reach > known and block_key(parent.digest, full_pages[known]) in parent.children:
            reach = known
        new_pages = list(pages[known:reach])
        new_checkpoints = {
            depth: handle
            for depth, handle in sorted(checkpoints.items())
            if depth <= reach and (depth > known or path[depth - 1].checkpoint is None)
        }
        for new, cached in ((new_pages, self._by_page), ([*new_checkpoints.values()], self._by_checkpoint)):
            if len(set(new)) < len(new) or any(handle in cached for handle in new):
                raise HandlesReused(new)
        for page, handle in zip(full_pages[known:reach], new_pages, strict=True):
            digest = block_key(parent.digest, page)
            node = PrefixNode(digest=digest, tokens=page, page=handle, parent=parent, depth=parent.depth + 1)
            parent.children[digest] = parent = node
            self._by_page[handle] = node
            self._num_idle_pages += 1
            path.append(node)
            if self.journal is not None:
                self.journal.page(digest, cached=True)
        for depth, handle in new_checkpoints.items():
            path[depth - 1].checkpoint = handle
            self._by_checkpoint[handle] = path[depth - 1]
            self._num_idle_checkpoints += path[depth - 1].users == 0
        self._stamp(path, users=0)
        return Handles(pages=tuple(new_pages), checkpoints=tuple(new_checkpoints.values()))

    def evict(self, pages_wanted: int, checkpoints_wanted: int = 0) -> Handles:
        """Give back idle entries, least recently used first, until the wanted numbers are freed or none
        is idle: first leaf pages (each with its checkpoint) until `pages_wanted`, then checkpoints
        alone (their pages stay) until `checkpoints_wanted`. Each kind comes back in eviction order."""
        if pages_wanted < 0 or checkpoints_wanted < 0:
            raise ValueError(f"wanted counts must be >= 0, got {pages_wanted}, {checkpoints_wanted}")
        pages, checkpoints = [], []
        while len(pages) < pages_wanted and (node := self._pop(leaf=True)):
            self._num_idle_pages -= 1
            del node.parent.children[node.digest], self._by_page[node.page]
            pages.append(node.page)
            if self.journal is not None:
                self.journal.page(node.digest, cached=False)
            if node.checkpoint is not None:
                checkpoints.append(self._drop_checkpoint(node))
            if node.parent.idle(leaf=True):  # false for the root
                self._push(node.parent, leaf=True)
        while len(checkpoints) < checkpoints_wanted and (node := self._pop(leaf=False)):
            checkpoints.append(self._drop_checkpoint(node))
        return Handles(pages=tuple(pages), checkpoints=tuple(checkpoints))

    def drop_all(self) -> Handles:
        """Give back every entry (end of a run); raises RuntimeError if a request still holds one."""
        if held := len(self._by_page) - self._num_idle_pages:
            raise PagesStillHeld(held)
        dropped = Handles(pages=tuple(self._by_page), checkpoints=tuple(self._by_checkpoint))
        for node in self._by_page.values() if self.journal is not None else ():
            self.journal.page(node.digest, cached=False)
        self._reset()
        return dropped

    def check(self, require: Callable[..., None] = require_or_raise) -> None:
        """Report every structural and accounting invariant through `require(ok, code, statement,
        subject)`. O(n)."""
        pages, checkpoints, stack = {}, {}, [self._root]
        while stack:
            node = stack.pop()
            require(
                node.child_users == sum(c.users for c in node.children.values()),
                "child-users",
                "users",
                f"{node.page}",
            )
            for digest, child in node.children.items():
                at = f"page {child.page} at depth {child.depth}"
                require(
                    child.parent is node and child.depth == node.depth + 1,
                    "parent-depth",
                    "parent, depth",
                    at,
                )
                require(len(child.tokens) == TOKEN_BYTES * self.page_size, "full-page", "one full page", at)
                require(
                    digest == child.digest == block_key(node.digest, child.tokens), "digest", "digest", at
                )
                require(
                    child.users >= child.child_users >= 0, "users-cover", "users cover the children's", at
                )
                require(
                    node is self._root or child.tick <= node.tick,
                    "tick-order",
                    "never used after its parent",
                    at,
                )
                require(
                    pages.setdefault(child.page, child) is child, "page-once", "page handle cached once", at
                )
                if child.checkpoint is not None:
                    require(
                        checkpoints.setdefault(child.checkpoint, child) is child,
                        "checkpoint-once",
                        "2nd checkpoint",
                        at,
                    )
                stack.append(child)
        require(
            pages == self._by_page and checkpoints == self._by_checkpoint,
            "handle-maps",
            "handle maps = the trie",
        )
        require(
            self.needs_checkpoint or not checkpoints,
            "checkpoints-needed",
            "no checkpoints unless needs_checkpoint",
        )
        idle = [n for n in pages.values() if n.users == 0]
        require(
            self.evictable() == (len(idle), sum(n.checkpoint is not None for n in idle)),
            "idle-counts",
            "idle counts",
        )
        for leaf, heap in self._heaps.items():
            current = {id(entry[2]) for entry in heap if entry[2].idle(leaf=leaf, tick=entry[0])}
            missing = [n.page for n in idle if n.idle(leaf=leaf) and id(n) not in current]
            require(not missing, "heap-entries", f"eviction candidates {missing} have a current heap entry")

    def _pages(self, tokens: Tokens) -> tuple[int, list[bytes]]:
        """(number of tokens, the full pages packed as int64 LE)."""
        array = np.asarray(tokens)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ValueError(f"tokens must be 1-D ints, got {array.dtype} of shape {array.shape}")
        data, step = array.astype("<i8", copy=False).tobytes(), TOKEN_BYTES * self.page_size
        return array.size, [data[start : start + step] for start in range(0, len(data) - step + 1, step)]

    def _walk(self, pages: list[bytes]) -> list[PrefixNode]:
        path: list[PrefixNode] = []
        node = self._root
        for page in pages:
            child = node.children.get(block_key(node.digest, page))
            if child is None or child.tokens != page:
                break
            path.append(node := child)
        return path

    def _path_of(self, pages: Sequence[int]) -> list[PrefixNode]:
        path = [self._by_page.get(page) for page in pages]
        for parent, node, page in zip([self._root, *path], path, pages, strict=False):
            if node is None or node.parent is not parent:
                raise NotACachedPrefix(pages, page)
        return path

    def _stamp(self, path: list[PrefixNode], *, users: int) -> None:
        """Add `users` to each node of a root path, stamp it with a new tick, queue new candidates."""
        self._clock += 1
        for node in path:
            idle_change = (node.users + users == 0) - (node.users == 0)
            self._num_idle_pages += idle_change
            self._num_idle_checkpoints += idle_change * (node.checkpoint is not None)
            node.users += users
            node.parent.child_users += users
            node.tick = self._clock
        for node in reversed(path):  # deepest first: on equal ticks, deeper entries go first
            for leaf in (True, False):
                if node.idle(leaf=leaf):
                    self._push(node, leaf=leaf)

    def _drop_checkpoint(self, node: PrefixNode) -> int:
        handle, node.checkpoint = node.checkpoint, None
        del self._by_checkpoint[handle]
        self._num_idle_checkpoints -= 1
        return handle

    def _push(self, node: PrefixNode, *, leaf: bool) -> None:
        heap = self._heaps[leaf]
        heapq.heappush(heap, (node.tick, next(self._seq), node))
        if len(heap) > 2 * len(self._by_page) + 64:  # drop stale entries: amortized O(1) per push
            heap[:] = [entry for entry in heap if entry[2].idle(leaf=leaf, tick=entry[0])]
            heapq.heapify(heap)

    def _pop(self, *, leaf: bool) -> PrefixNode | None:
        heap = self._heaps[leaf]
        while heap:
            tick, _, node = heapq.heappop(heap)
            if node.idle(leaf=leaf, tick=tick):
                return node
        return None
