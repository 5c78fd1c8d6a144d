"""The pilot-commit allocator: pilots, then the budget by p(1-p), by hand."""

from __future__ import annotations

from agentrl.allocator_options import PilotCommitOptions
from agentrl.rollout.allocators import AllocState, Budget, PilotCommit, pilot_commit_split
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import linear


def test_pilot_commit_split_is_proportional_to_p_one_minus_p():
    alloc, skipped = pilot_commit_split([0.5, 0.25, 1.0, 0.0], 14, min_per_task=1)
    # saturated tasks get 1 each; 12 split 0.25 : 0.1875 -> 6.857, 5.143 -> 7, 5
    assert alloc == [7, 5, 1, 1]
    # an even split of 14 is [4, 4, 3, 3]: the saturated tasks lost 2 + 2
    assert skipped == 4
    assert pilot_commit_split([1.0, 0.0], 5) == ([3, 2], 0)  # all saturated: even
    assert pilot_commit_split([None, 0.5], 4) == ([2, 2], 0)  # no pilots: p = 1/2


def test_pilot_commit_two_rounds_by_hand():
    trees = [RolloutTree() for _ in range(4)]
    outcomes = [[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]  # p = .5 .25 1 0
    state = AllocState(trees, Budget(30))
    alloc = PilotCommit(PilotCommitOptions(pilots=4, min_per_task=1))
    assert [(r.task, r.n) for r in alloc.plan(state)] == [(t, 4) for t in range(4)]
    for tree, wins in zip(trees, outcomes, strict=True):
        for w in wins:
            linear(tree, [{"terminated": True, "reward": float(w)}])
    state.spent, state.round = 16, 1
    assert [(r.task, r.n) for r in alloc.plan(state)] == [(0, 7), (1, 5), (2, 1), (3, 1)]
    report = state.report["pilot_commit"]
    assert report["p"] == [0.5, 0.25, 1.0, 0.0]
    assert report["skipped_budget"] == 4
    # success in info wins over reward
    trees[3].nodes[0].info["success"] = True
    state.round = 1
    alloc.plan(state)
    assert state.report["pilot_commit"]["p"][3] == 0.25


def test_pilot_commit_clips_pilots_to_a_small_budget():
    state = AllocState([RolloutTree() for _ in range(3)], Budget(4))
    reqs = PilotCommit(PilotCommitOptions(pilots=2)).plan(state)
    assert sum(r.n for r in reqs) == 4
    assert [r.n for r in reqs] == [2, 1, 1]
