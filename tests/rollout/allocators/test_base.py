"""Budget arithmetic the allocators share: even fills, proportional splits, leaves a budget buys."""

from __future__ import annotations

import pytest

from agentrl.rollout.allocators import (
    AllocState,
    Budget,
    affordable_leaves,
    fill_evenly,
    largest_remainder,
)
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import linear


def test_fill_evenly_gives_each_unit_to_the_slot_with_fewest():
    assert fill_evenly([0, 0, 0], 7) == [3, 2, 2]
    assert fill_evenly([5, 0, 1], 4) == [0, 3, 1]
    assert fill_evenly([0, 0, 0], 7, caps=[1, 5, 5]) == [1, 3, 3]
    assert fill_evenly([0, 0], 9, caps=[2, 3]) == [2, 3]  # caps bind: 4 units not given


def test_largest_remainder_sums_exactly_to_total():
    # quotas 12 * (0.25, 0.1875) / 0.4375 = 6.857, 5.143: the spare unit goes to the first
    assert largest_remainder([0.25, 0.1875, 0.0], 12) == [7, 5, 0]
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]
    assert largest_remainder([0.0, 0.0], 5) == [0, 0]


def test_affordable_leaves_converts_turns_and_tokens_with_the_mean_episode():
    tree = RolloutTree()
    linear(tree, [{"action_ids": [1]}] * 2 + [{"action_ids": [1, 2], "terminated": True}])
    linear(tree, [{"action_ids": [1]}] * 4 + [{"action_ids": [1], "terminated": True}])
    state = AllocState([tree], Budget(26, "turns"), spent=8)
    assert affordable_leaves(state) == 4  # 18 turns left / (3 + 5) / 2 turns per episode
    state = AllocState([tree], Budget(20, "tokens"), spent=8)
    assert affordable_leaves(state) == 2  # 12 / mean(4, 5) tokens
    fresh = AllocState([RolloutTree()], Budget(20, "turns"))
    assert affordable_leaves(fresh) == 2  # the default guess of 8 turns per episode
    assert affordable_leaves(fresh, est_leaf_cost=6) == 3
    assert affordable_leaves(AllocState([tree], Budget(9), spent=2)) == 7


@pytest.mark.parametrize("total, unit, match", [
    (10, "episodes", "unit 'episodes' is none of leaves, turns, tokens"),
    (10, "Turns", "unit 'Turns' is none of leaves, turns, tokens"),
    (2.5, "leaves", "total 2.5 is not a whole number"),
    (True, "leaves", "total True is not a whole number"),
    (-1, "turns", "total -1 is negative"),
])
def test_a_budget_in_an_unknown_unit_or_of_no_whole_size_is_refused(total, unit, match):
    # Budget(8, "episodes") was taken as a tokens budget (every unit but leaves and turns
    # was charged per token), and Budget(2.5) planned 2.5 leaves' worth of fill_evenly
    with pytest.raises(ValueError, match=match):
        Budget(total, unit)
