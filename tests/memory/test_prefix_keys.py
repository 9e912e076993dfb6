"""Token sequences kept by their prefixes: the longest proper prefix of a prompt and the keys a new one
supersedes, checked against a plain scan of every key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from distpool.memory.prefix.block_keys import chained_block_keys
from distpool.memory.prefix.prefix_keys import PrefixKeys

TURN_ONE = list(range(1, 41))  # 40 tokens: two blocks of 16 and 8 more


def test_a_later_turn_finds_its_conversation_and_supersedes_it():
    keys: PrefixKeys[str] = PrefixKeys(16)
    keys.add(TURN_ONE, "turn one")
    keys.add([9, 9, 9], "another conversation")
    prompt = TURN_ONE + [50, 51]
    assert keys.longest_proper_prefix(prompt) == (tuple(TURN_ONE), "turn one")
    assert keys.longest_proper_prefix(TURN_ONE) is None  # itself is not a proper prefix
    assert keys.longest_proper_prefix([0, *TURN_ONE]) is None
    assert keys.add(prompt, "turn two") == ["turn one"]
    assert list(keys) == [(9, 9, 9), tuple(prompt)]


def test_least_recently_used_goes_first_and_a_touch_renews():
    keys: PrefixKeys[int] = PrefixKeys(4)
    for i in range(3):
        keys.add([i] * 5, i)
    keys.touch((0,) * 5)
    assert keys.pop_oldest() == 1 and keys.pop_oldest() == 2 and keys.pop_oldest() == 0
    assert len(keys) == 0 and keys.prefixes_of([0] * 9, proper=True) == []


def test_block_keys_identify_the_whole_prefix():
    a = chained_block_keys([1, 2, 3, 4, 5, 6], 2)
    b = chained_block_keys([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and a[0] != b[0] and a[1] != b[1]  # same block, different prefix
    assert chained_block_keys([1, 2, 3, 4, 5, 6], 2, limit=1) == a[:1]


tokens = st.lists(st.integers(0, 3), max_size=20)


@settings(max_examples=150, deadline=None)
@given(block=st.integers(1, 5), kept=st.lists(tokens, max_size=12), prompts=st.lists(tokens, max_size=6))
def test_lookups_agree_with_a_scan_of_every_key(block, kept, prompts):
    keys: PrefixKeys[int] = PrefixKeys(block)
    plain: dict[tuple[int, ...], int] = {}
    for i, key in enumerate(kept):
        t = tuple(key)
        expected_superseded = sorted(v for k, v in plain.items() if t[: len(k)] == k)
        assert sorted(keys.add(key, i)) == expected_superseded
        plain = {k: v for k, v in plain.items() if t[: len(k)] != k} | {t: i}
    assert set(keys) == set(plain)
    for prompt in prompts:
        p = tuple(prompt)
        proper = [k for k in plain if len(k) < len(p) and p[: len(k)] == k]
        assert sorted(keys.prefixes_of(prompt, proper=True)) == sorted(proper)
        longest = max(proper, key=len) if proper else None
        found = keys.longest_proper_prefix(prompt)
        assert (found[0] if found else None) == longest
