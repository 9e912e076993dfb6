"""What is kept for reuse: cached prefix pages and checkpoints, and decode's kept final states.

`block_keys.py`: the one key of a prefix, chained block by block (decode's index, its final states
and the driver use it alike);
`prefix_index.py` is the trie of full pages by token content;
`prefix_cache.py` holds those pages in the pool and evicts least recently used first;
`final_states.py` keeps a finished request's final state and partial page on decode, so its next turn
is prefilled where it decoded;
`prefix_keys.py`: token sequences kept by their prefixes (the final states');
`cache_view.py`: what decode cached and evicted, reported with its results, and the driver's copy of
its keys.
"""

from distpool.memory.prefix.block_keys import StateKey, chained_block_keys, prefix_key
from distpool.memory.prefix.cache_view import CacheJournal, CacheKeys, CacheNews, CacheView
from distpool.memory.prefix.final_states import FinalStates
from distpool.memory.prefix.prefix_cache import PrefixCache
from distpool.memory.prefix.prefix_index import PrefixMatch
from distpool.memory.prefix.prefix_keys import PrefixKeys

__all__ = [
    "CacheJournal",
    "CacheKeys",
    "CacheNews",
    "CacheView",
    "FinalStates",
    "PrefixCache",
    "PrefixKeys",
    "PrefixMatch",
    "StateKey",
    "chained_block_keys",
    "prefix_key",
]
