"""Allocators under a turns budget: no plan buys more turns than are left.

An open leaf (paused by ``max_turns``) spends more turns when it is continued; the
plans bought new leaves with all that was left, as if those continuations were free,
so a segment tree planned more turns than its budget (the engine then stopped the
episodes at the real limit: nothing broke, but the plan and its report were wrong).
"""

from __future__ import annotations

import pytest

from agentrl.allocator_options import (
    ContrastiveOptions,
    EntropyBranchOptions,
    IndependentOptions,
    KeyStateOptions,
    PilotCommitOptions,
    SegmentTreeOptions,
)
from agentrl.rollout.allocators import (
    AllocState,
    Branch,
    Budget,
    Contrastive,
    EntropyBranch,
    Fresh,
    Independent,
    KeyState,
    PilotCommit,
    SegmentTree,
    affordable_leaves,
)
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import FakeEngine, linear


def test_affordable_leaves_keeps_the_turns_that_open_leaves_will_spend():
    # One finished 4-turn episode and two episodes paused after 1 turn: 6 of 20 turns spent.
    # A finished episode costs 4 turns, so each open leaf will spend about 4 - 1 = 3 more
    # when continued: 14 - 6 = 8 turns left for new leaves, 2 of them (14 // 4 = 3 overspent).
    tree = RolloutTree()
    linear(tree, [{"action_ids": [1]}] * 3 + [{"action_ids": [1], "terminated": True}])
    linear(tree, [{"action_ids": [1], "open": True}])
    linear(tree, [{"action_ids": [1], "open": True}])
    assert affordable_leaves(AllocState([tree], Budget(20, "turns"), spent=6)) == 2
    # An open leaf longer than the finished episodes will cost at least one turn more: a
    # finished 4-turn episode and one paused after 5 turns (at least 6) cost (4 + 6) / 2 = 5
    # turns a leaf, and the open one keeps 1: (24 - 9 - 1) // 5 = 2 (15 // 4 = 3 overspent).
    longer = RolloutTree()
    linear(longer, [{"action_ids": [1]}] * 3 + [{"action_ids": [1], "terminated": True}])
    linear(longer, [{"action_ids": [1]}] * 4 + [{"action_ids": [1], "open": True}])
    assert affordable_leaves(AllocState([longer], Budget(24, "turns"), spent=9)) == 2
    # leaves budgets are unchanged: open leaves are already counted as leaves
    assert affordable_leaves(AllocState([tree], Budget(9), spent=3)) == 6


def _exact(length: float) -> list:
    """Every allocator, told the true cost of an episode (``est_leaf_cost``)."""
    return [
        Independent(IndependentOptions(n="all", est_leaf_cost=length)),
        PilotCommit(PilotCommitOptions(pilots=2, min_per_task=1, est_leaf_cost=length)),
        EntropyBranch(EntropyBranchOptions(threshold=0.5, est_leaf_cost=length)),
        SegmentTree(SegmentTreeOptions(depth=3, width=2, est_leaf_cost=length)),
        SegmentTree(SegmentTreeOptions(depth=2, width=3, segment_turns=2, est_leaf_cost=length)),
        KeyState(KeyStateOptions(top1_threshold=0.5, est_leaf_cost=length)),
        Contrastive(ContrastiveOptions(est_leaf_cost=length)),
    ]


@pytest.mark.parametrize("length", [3, 8])
@pytest.mark.parametrize("budget", [40, 57, 100])
def test_no_round_plans_more_turns_than_are_left(length, budget):
    # episodes all last `length` turns and every allocator knows it: each round's plan,
    # played out, must fit what was left when it was made
    for alloc in _exact(float(length)):
        engine = FakeEngine(lengths=[length, length])
        state = AllocState(trees=[RolloutTree(), RolloutTree()], budget=Budget(budget, "turns"))
        while state.round < 20:
            reqs = alloc.plan(state)
            if not reqs:
                break
            before = engine.turns_used
            for r in reqs:
                engine.apply(state, r)
            played = engine.turns_used - before
            assert played <= state.remaining, (
                f"{alloc.name} round {state.round} planned {played} turns, {state.remaining} left: {reqs}")
            state.spent = engine.turns_used
            state.round += 1
        assert state.spent > 0


@pytest.mark.parametrize("alloc", [
    Contrastive(ContrastiveOptions()),
    EntropyBranch(EntropyBranchOptions(threshold=0.5)),
    EntropyBranch(EntropyBranchOptions(threshold=0.5, in_turn=True)),
    KeyState(KeyStateOptions(top1_threshold=0.5)),
], ids=lambda a: a.name)
def test_branches_are_priced_by_what_continuing_from_their_point_costs(alloc):
    # Task 0 ends after 1 turn (no branch point), task 1 after 9: 3 + 9 = 12 of 30 turns spent.
    # The mean episode costs 12 / 4 = 3 turns, so 18 turns bought 6 leaves, and the branch
    # round spent them all in task 1, where a continuation from turn 1 costs 8 turns, not 3:
    # its plan played 30 or more turns with 18 left. Priced by the finished episodes below each
    # point, the branches fit what is left.
    engine = FakeEngine(lengths=[1, 9])
    state = AllocState(trees=[RolloutTree(), RolloutTree()], budget=Budget(30, "turns"))
    engine.apply(state, Fresh(0, 3))
    engine.apply(state, Fresh(1, 1))
    state.spent, state.round = engine.turns_used, 1
    reqs = alloc.plan(state)
    assert any(isinstance(r, Branch) for r in reqs)
    for r in reqs:
        engine.apply(state, r)
    assert engine.turns_used - 12 <= 18, reqs


def test_an_open_leaf_is_priced_by_the_finished_episodes_that_went_past_it():
    # Task 0 finished in 2 turns; task 1 is paused after 2 (open): 4 of 40 turns spent. Priced
    # by the mean finished episode (2 turns), the open leaf was expected to spend 1 more turn,
    # and (40 - 4 - 1) // 2.5 = 14 leaves were bought (a segment tree of tasks of 2 and 10
    # turns then planned 2.4 times its budget). No finished episode went past 2 turns: the
    # guess of 8 turns holds, 6 more to come: (36 - 6) // ((2 + 8) / 2) = 6 leaves.
    short, long_ = RolloutTree(), RolloutTree()
    linear(short, [{"action_ids": [1]}, {"action_ids": [1], "terminated": True}])
    linear(long_, [{"action_ids": [1]}, {"action_ids": [1], "open": True}])
    assert affordable_leaves(AllocState([short, long_], Budget(40, "turns"), spent=4)) == 6
    assert affordable_leaves(AllocState([short, long_], Budget(40, "turns"), spent=4), est_leaf_cost=10) == 4
    # A finished 6-turn episode went past it: expected 6, 4 to come; (40 - 10 - 4) // (14 / 3) = 5
    # (the mean of all, 4 turns, gave 7)
    linear(short, [{"action_ids": [1]}] * 5 + [{"action_ids": [1], "terminated": True}])
    assert affordable_leaves(AllocState([short, long_], Budget(40, "turns"), spent=10)) == 5
