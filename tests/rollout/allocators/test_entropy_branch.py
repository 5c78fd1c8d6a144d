"""The entropy-branch allocator: scores by hand (ARPO rise, AEPO penalty) and its plan."""

from __future__ import annotations

import pytest

from agentrl.allocator_options import EntropyBranchOptions
from agentrl.rollout.allocators import (
    AllocState,
    Branch,
    Budget,
    EntropyBranch,
    Fresh,
    entropy_branch_scores,
    leaf_cost,
)
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import linear


def _entropy_tree() -> tuple[RolloutTree, list[int], list[int]]:
    tree = RolloutTree()
    a = linear(tree, [
        {"entropies": [0.2, 0.2]},
        {"entropies": [1.0, 1.0, 9.0]},  # first 2 tokens: rise 0.8
        {"entropies": [1.4, 1.4]},  # rise 1.2, but follows a high turn: 0.6
        {"entropies": [0.2], "terminated": True},
    ])
    b = linear(tree, [{"entropies": [0.5]}, {"entropies": [1.2], "terminated": True}])  # rise 0.7
    return tree, a, b


def test_entropy_scores_rise_over_first_turn_with_consecutive_penalty():
    tree, a, b = _entropy_tree()
    scores = entropy_branch_scores(tree, first_tokens=2, threshold=0.5, penalty=0.5)
    assert scores == pytest.approx({a[1]: 0.8, a[2]: 0.6, b[1]: 0.7})
    # without the penalty turn a2 ranks first; a harder penalty drops it
    assert entropy_branch_scores(tree, 2, 0.5, 1.0)[a[2]] == pytest.approx(1.2)
    assert a[2] not in entropy_branch_scores(tree, 2, 0.5, 0.4)


def test_entropy_branch_branches_before_the_highest_scores_then_fresh():
    tree, a, b = _entropy_tree()
    alloc = EntropyBranch(EntropyBranchOptions(first_tokens=2, threshold=0.5, penalty=0.5, k=2))
    state = AllocState([tree], Budget(11), spent=6, round=1)  # 5 leaves left
    reqs = alloc.plan(state)
    # a1 (0.8) -> branch at a0; b1 (0.7) -> at b0; a2 (0.6) -> at a1, 1 leaf left
    assert reqs == [Branch(0, a[0], 2, reason="entropy rise"), Branch(0, b[0], 2, reason="entropy rise"),
                    Branch(0, a[1], 1, reason="entropy rise")]
    state = AllocState([tree], Budget(14), spent=6, round=1)  # 8 left: 6 branch, 2 fresh
    reqs = alloc.plan(state)
    assert sum(leaf_cost(tree, r) for r in reqs) == 8
    assert reqs[-1] == Fresh(0, 2, reason="no high-entropy turn left")
    assert state.report["entropy_branch"] == {"candidates": 3, "branches": 3, "fresh_leftover": 2,
                                              "branch_points": [(0, a[0]), (0, b[0]), (0, a[1])]}


def test_entropy_branch_opening_round_takes_fresh_fraction():
    state = AllocState([RolloutTree() for _ in range(3)], Budget(10))
    assert [r.n for r in EntropyBranch(EntropyBranchOptions(fresh_fraction=0.5)).plan(state)] == [2, 2, 1]
    state = AllocState([RolloutTree() for _ in range(3)], Budget(4))
    assert [r.n for r in EntropyBranch(EntropyBranchOptions(fresh_fraction=0.5)).plan(state)] == [1, 1, 1]  # one per task


def test_entropy_scores_of_a_long_chain_take_one_walk_not_one_per_turn():
    """Each turn walked its whole path to find the episode's first turn: a chain of 20,000 turns
    took 18 s (the viewer scores every entropy_branch tree it draws)."""
    import time

    tree = RolloutTree()
    ids = linear(tree, [{"entropies": [0.2]}] + [{"entropies": [1.0 if t % 2 else 0.2]} for t in range(1, 20_000)])
    t0 = time.process_time()  # this process's CPU time, which other load on the machine does not stretch
    scores = entropy_branch_scores(tree, first_tokens=1, threshold=0.5, penalty=0.5)
    assert time.process_time() - t0 < 3.0  # linear: about 0.1 s
    # odd turns rise 0.8 over the first turn's 0.2; the even turns between them do not, so no penalty
    assert scores == pytest.approx({ids[t]: 0.8 for t in range(1, 20_000, 2)})
