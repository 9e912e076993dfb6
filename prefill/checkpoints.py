"""Where a prefill writes its state checkpoint, and which prompts of a batch wait for another's.

A hybrid Mamba prefix is usable only up to a page boundary holding a checkpoint (a slot-sized copy
of the recurrent state there), and a prefill writes at most one, in the same pass. Where it goes
decides what later prompts can reuse:

    cached:  [S S S S|a a]          S: a system prompt shared by many users, a and b: two users
    new:     [S S S S|b b b]        the new prompt leaves the cached path after S
                     ^ the shared boundary: every later user of S hits here

- **the shared boundary**: the deepest page boundary up to which the prompt shares its pages with
  another prompt, cached or in the same batch, when that lies beyond its usable match. A prefix two
  prompts share is the best evidence a third will share it too.
- else **its own end**: the deepest boundary a later prompt can start from, (n - 1) // page_size
  pages (a match never covers the whole prompt: the last token must run to give the first token),
  so a repeat of the same prompt, or one that extends it, hits all but its last page at most.

A checkpoint can only serve prompts prefilled after it is written, so a batch is split in two
waves: a prompt sharing more pages with an earlier prompt of the batch than the cache gives it
follows that *leader* into the second wave; the leader writes its checkpoint at the boundary all
its followers share, and the followers match again once it is cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def checkpoint_depth(num_tokens: int, page_size: int, matched_pages: int, shared_pages: int) -> int | None:
    """The page depth of a prompt's checkpoint: the shared boundary when it lies between the usable
    match and the prompt's own end, else its own end; None when neither lies past the match."""
    end = (num_tokens - 1) // page_size
    depth = shared_pages if matched_pages < shared_pages < end else end
    return depth if depth > matched_pages else None


def common_pages(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Full pages two prompts hold alike from the start."""
    pages = 0
    while (pages + 1) * page_size <= min(len(a), len(b)):
        start, stop = pages * page_size, (pages + 1) * page_size
        if a[start:stop] != b[start:stop]:
            break
        pages += 1
    return pages


@dataclass(frozen=True)
class Waves:
    """A batch split for sharing: `first` and `then` are batch positions, in batch order;
    `leader_pages[i]` is the boundary leader i shares with all of its followers."""

    first: list[int]
    then: list[int] = field(default_factory=list)
    leader_pages: dict[int, int] = field(default_factory=dict)


def split_waves(prompts: Sequence[Sequence[int]], matched_pages: Sequence[int], page_size: int) -> Waves:
    """Put each prompt that shares more full pages with an earlier first-wave prompt (its leader)
    than either has usable in the cache into the second wave. Shares count up to the follower's
    usable end ((n - 1) // page_size) and the leader's length."""
    first: list[int] = []
    then: list[int] = []
    leader_pages: dict[int, int] = {}
    for i, prompt in enumerate(prompts):
        usable = (len(prompt) - 1) // page_size
        best, leader = 0, None
        for j in first:
            shared = min(common_pages(prompt, prompts[j], page_size), usable)
            if shared > max(best, matched_pages[i], matched_pages[j]):
                best, leader = shared, j
        if leader is None:
            first.append(i)
            continue
        then.append(i)
        leader_pages[leader] = min(leader_pages.get(leader, best), best)
    return Waves(first=first, then=then, leader_pages=leader_pages)
