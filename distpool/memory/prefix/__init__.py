"""What is kept for reuse: cached prefix pages and checkpoints, and decode's kept final states.

`prefix_index.py` is the trie of full pages by token content (its nodes and chained digest);
`prefix_cache.py` holds those pages in the pool and evicts least recently used first;
`final_states.py` keeps a finished request's final state and partial page on decode, so its next turn
is prefilled where it decoded;
`prefix_keys.py`: token sequences kept by their prefixes (final states, and the driver's mirror).
"""

from distpool.memory.prefix.final_states import FinalStates
from distpool.memory.prefix.prefix_cache import PrefixCache
from distpool.memory.prefix.prefix_index import PrefixMatch
from distpool.memory.prefix.prefix_keys import PrefixKeys, chained_block_keys

__all__ = ["FinalStates", "PrefixCache", "PrefixKeys", "PrefixMatch", "chained_block_keys"]
