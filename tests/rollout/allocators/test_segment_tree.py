"""The segment-tree allocator (TreePO): full trees, late splits, budget given back."""

from __future__ import annotations

from agentrl.allocator_options import SegmentTreeOptions
from agentrl.rollout.allocators import (
    AllocState,
    Branch,
    Budget,
    Fresh,
    SegmentTree,
    is_open,
    segment_children,
)
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import FakeEngine, drive


def test_segment_children_branches_as_late_as_width_allows():
    assert segment_children(2, 8, 2, 2) == 3  # 10 leaves in 2 more levels: 3 now
    assert segment_children(3, 7, 1, 2) == 5
    assert segment_children(5, 5, 0, 2) == 10
    assert segment_children(4, 0, 2, 2) == 4  # nothing more to add: one child each


def test_segment_tree_full_tree_has_width_to_the_depth_leaves():
    engine = FakeEngine(lengths=[10, 10])
    state = drive(SegmentTree(SegmentTreeOptions(depth=3, width=2)), engine, Budget(16))
    assert [len(t.leaves()) for t in state.trees] == [8, 8]
    for tree in state.trees:
        assert len(tree.roots) == 2
        splits = [len(n.children) for n in tree.nodes.values() if len(n.children) > 1]
        assert splits == [2] * 6  # 2 roots, then 4 level-1 segments, each split in 2
        assert not any(is_open(n) for n in tree.leaves())


def test_segment_tree_gives_back_budget_of_early_finished_branches():
    # task 1's episodes end after 2 turns, before the third level: its last
    # level cannot split, and the 4 leaves it leaves unspent become fresh episodes
    engine = FakeEngine(lengths=[4, 2])
    alloc = SegmentTree(SegmentTreeOptions(depth=3, width=2))
    state = AllocState([RolloutTree(), RolloutTree()], Budget(16))
    reqs = alloc.plan(state)
    assert reqs == [Fresh(0, 2, 1, reason="segment"), Fresh(1, 2, 1, reason="segment")]
    for r in reqs:
        engine.apply(state, r)
    state.spent, state.round = 4, 1
    reqs = alloc.plan(state)
    assert [(r.task, r.k, r.max_turns) for r in reqs] == [(0, 2, 1), (0, 2, 1), (1, 2, 1), (1, 2, 1)]
    for r in reqs:
        engine.apply(state, r)
    state.spent, state.round = 8, 2
    reqs = alloc.plan(state)
    assert [(r.task, r.k, r.max_turns) for r in reqs if isinstance(r, Branch)] == [(0, 2, None)] * 4
    assert [r for r in reqs if isinstance(r, Fresh)] == [Fresh(1, 4, reason="given back by early finish")]
    assert state.report["segment_tree"]["given_back"] == 4


def test_segment_tree_moves_unspent_budget_to_other_tasks_open_leaves():
    # task 1 ends after one turn: its 4 missing leaves can grow task 0's tree
    # (2 of them, task 0 can still double twice) and the rest start fresh
    engine = FakeEngine(lengths=[5, 1])
    state = drive(SegmentTree(SegmentTreeOptions(depth=3, width=2)), engine, Budget(12))
    assert [len(t.leaves()) for t in state.trees] == [8, 4]
    assert state.report["segment_tree"]["targets"] == [6, 6]
    assert state.report["segment_tree"]["given_back"] == 2
