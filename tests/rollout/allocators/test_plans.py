"""Every allocator through a simulated engine loop: budgets met, trees grown, segment forks read."""

from __future__ import annotations

import pytest

from agentrl.allocator_options import (
    EntropyBranchOptions,
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
    Independent,
    KeyState,
    PilotCommit,
    SegmentTree,
    contrastive_branch_points,
    entropy_branch_scores,
    is_open,
    prefix_groups,
)
from agentrl.rollout.tree import split_node
from agentrl.types import Node, RolloutTree
from tests.rollout.allocators.sim import FakeEngine, drive, linear, total_leaves

ALL = [
    Independent(),
    PilotCommit(PilotCommitOptions(pilots=2, min_per_task=1)),
    EntropyBranch(EntropyBranchOptions(threshold=0.5)),
    SegmentTree(SegmentTreeOptions(depth=3, width=2)),
    KeyState(KeyStateOptions(top1_threshold=0.5)),
    Contrastive(),
]


@pytest.mark.parametrize("alloc", ALL, ids=lambda a: a.name)
@pytest.mark.parametrize("budget", [24, 17, 2])
def test_simulated_engine_spends_exactly_the_leaves_budget(alloc, budget):
    engine = FakeEngine(lengths=[3, 1, 4])
    state = drive(alloc, engine, Budget(budget))
    assert total_leaves(state) == budget
    assert state.spent == budget
    assert not any(is_open(n) for t in state.trees for n in t.leaves())
    assert all(n.done for t in state.trees for n in t.leaves())


@pytest.mark.parametrize("alloc", ALL, ids=lambda a: a.name)
def test_simulated_engine_stays_within_a_turns_budget(alloc):
    engine = FakeEngine(lengths=[3, 3, 3])
    state = drive(alloc, engine, Budget(40, "turns"))
    assert 0 < state.spent <= 40
    assert not any(is_open(n) for t in state.trees for n in t.leaves())


def test_simulated_engine_branches_where_the_signals_are():
    # turn t has entropy 0.2 + 0.7 t and top-1 0.9 - 0.3 t: the branching
    # allocators must grow real trees, not only fresh episodes
    for alloc in (EntropyBranch(), KeyState(), Contrastive(), SegmentTree()):
        state = drive(alloc, FakeEngine(lengths=[4, 4]), Budget(20))
        assert any(len(n.children) > 1 for t in state.trees for n in t.nodes.values()), alloc.name


def test_allocators_read_turns_across_a_segment_fork():
    # split_node puts a partial node (id 3) above an older node (id 1): the
    # turn a1 is partial 3 plus node 1, and node 4 is a sibling segment of it
    tree = RolloutTree()
    a = linear(tree, [{"entropies": [0.2] * 4, "action_ids": [1] * 4},
                      {"entropies": [1.0] * 4, "action_ids": [1] * 4}, {"terminated": True}])
    part = split_node(tree, a[1], 2)
    q = tree.add(Node(entropies=[1.0, 1.0], terminated=True), part.id)
    assert (part.id, q.id) == (3, 4)
    assert entropy_branch_scores(tree, first_tokens=2) == pytest.approx({a[1]: 0.8, q.id: 0.8})
    state = AllocState([tree], Budget(10), spent=2, round=1)
    reqs = EntropyBranch(EntropyBranchOptions(first_tokens=2, k=2)).plan(state)
    assert reqs[0] == Branch(0, a[0], 2, reason="entropy rise")  # both turns start after a0: once
    assert all(not (isinstance(r, Branch) and r.node == a[0]) for r in reqs[1:])
    # the fork counts as a branch point at turn 1: a1 weighs 0.5 (path) * 0.5 (depth)
    assert list(contrastive_branch_points([tree])) == [(0, a[0]), (0, a[1])]
    assert prefix_groups(tree) == [{"node": part.id, "leaves": [a[2], q.id]}]
