"""Token sequences kept by their prefixes, least recently used first: the longest kept sequence a
prompt extends, found in one pass over the prompt.

Decode's final states (`final_states.py`) keep token sequences and ask two things of a prompt: the
longest kept sequence that is a proper prefix of it, and every kept sequence a new one extends (a
conversation's later turn supersedes its earlier ones). Comparing the prompt with every key costs
O(keys x prompt length). Here a key is filed under the chained key of its full blocks
(`block_keys.py`), so a prompt is hashed once, block by block, and each of its block boundaries
costs one dict lookup and a comparison of less than a block of tokens. A candidate is compared
whole before it is returned: a hash collision can cost a comparison, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from distpool.memory.prefix.block_keys import ROOT_KEY, chained_block_keys

V = TypeVar("V")
Key = tuple[int, ...]


class PrefixKeys(Generic[V]):
    """Token sequences (keys) with a value each, least recently used first."""

    def __init__(self, block: int) -> None:
        if block < 1:
            raise ValueError(f"a block holds at least one token; got {block}")
        self.block = block
        self._values: OrderedDict[Key, V] = OrderedDict()
        self._filed: dict[bytes, set[Key]] = {}  # the chained key of their full blocks -> keys

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._values)

    def values(self) -> Iterator[V]:
        return iter(self._values.values())

    def add(self, key: Sequence[int], value: V) -> list[V]:
        """Keep `value` under `key`, most recently used; every kept key that `key` extends (itself
        included) is removed first. Returns the removed values."""
        key = tuple(key)
        superseded = [self.pop(k) for k in self.prefixes_of(key, proper=False)]
        self._values[key] = value
        self._filed.setdefault(self._place(key), set()).add(key)
        return superseded

    def longest_proper_prefix(self, prompt: Sequence[int]) -> tuple[Key, V] | None:
        """The longest kept key that is a proper prefix of `prompt`, with its value (read-only)."""
        found = self.prefixes_of(prompt, proper=True)
        if not found:
            return None
        key = max(found, key=len)
        return key, self._values[key]

    def prefixes_of(self, prompt: Sequence[int], *, proper: bool) -> list[Key]:
        """Every kept key that is a prefix of `prompt` (shorter than it, if `proper`)."""
        if not self._values:
            return []
        end = len(prompt) - 1 if proper else len(prompt)  # the longest key that may match
        if end < 0:
            return []
        chain = [ROOT_KEY, *chained_block_keys(prompt, self.block, end // self.block)]
        found = []
        for chained in chain:
            for key in self._filed.get(chained, ()):
                if len(key) <= end and tuple(prompt[: len(key)]) == key:
                    found.append(key)
        return found

    def touch(self, key: Key) -> None:
        """Mark `key` most recently used."""
        self._values.move_to_end(key)

    def pop(self, key: Key) -> V:
        value = self._values.pop(key)
        place = self._place(key)
        filed = self._filed[place]
        filed.discard(key)
        if not filed:
            del self._filed[place]
        return value

    def pop_oldest(self) -> V:
        """Remove the least recently used key; its value. KeyError when nothing is kept."""
        return self.pop(next(iter(self._values)))

    def _place(self, key: Key) -> bytes:
        chain = chained_block_keys(key, self.block)
        return chain[-1] if chain else ROOT_KEY
