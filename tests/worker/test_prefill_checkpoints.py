"""Where a prefill writes its checkpoint, and which prompts of a batch wait for another's."""

from __future__ import annotations

import pytest

from prefill.checkpoints import Waves, checkpoint_depth, common_pages, split_waves

PAGE = 4


@pytest.mark.parametrize(
    "tokens, matched, shared, depth",
    [
        (64, 0, 0, 15),  # its own end: a repeat must compute the last token, so 15 pages, not 16
        (65, 0, 0, 16),
        (3, 0, 0, None),  # not one full page before the last token
        (100, 0, 10, 10),  # the boundary it shares with another prompt
        (100, 10, 10, 24),  # shared, but usable already: its own end
        (100, 0, 24, 24),
        (100, 24, 0, None),  # everything usable is matched: nothing new to write
    ],
)
def test_the_checkpoint_goes_where_prompts_share_else_at_the_prompts_own_end(tokens, matched, shared, depth):
    assert checkpoint_depth(tokens, PAGE, matched, shared) == depth


def test_common_pages_counts_whole_pages_alike_from_the_start():
    assert common_pages([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9], PAGE) == 1
    assert common_pages([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9], PAGE) == 2
    assert common_pages([1, 2, 3], [1, 2, 3], PAGE) == 0


def test_prompts_sharing_a_prefix_follow_the_first_one_and_it_checkpoints_where_all_share():
    system = list(range(100, 120))  # 5 pages
    a, b, c = system + [1] * 9, system + [2] * 9, system[:8] + [3] * 9  # c shares 2 pages only
    other = list(range(50, 80))
    waves = split_waves([a, other, b, c], [0, 0, 0, 0], PAGE)
    assert waves == Waves(first=[0, 1], then=[2, 3], leader_pages={0: 2})


def test_a_prompt_the_cache_serves_as_well_does_not_wait():
    system = list(range(100, 120))
    waves = split_waves([system + [1] * 9, system + [2] * 9], [5, 5], PAGE)
    assert waves == Waves(first=[0, 1])
    identical = list(range(16))  # 4 pages; a repeat can use 3
    assert split_waves([identical] * 3, [0, 0, 0], PAGE) == Waves(first=[0], then=[1, 2], leader_pages={0: 3})
