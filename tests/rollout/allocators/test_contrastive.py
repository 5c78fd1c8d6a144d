"""The contrastive allocator (CBPO): decayed branch points and exact-prefix groups."""

from __future__ import annotations

from agentrl.allocator_options import ContrastiveOptions
from agentrl.rollout.allocators import (
    AllocState,
    Branch,
    Budget,
    Contrastive,
    contrastive_branch_points,
    prefix_groups,
)
from agentrl.types import Node, RolloutTree
from tests.rollout.allocators.sim import FakeEngine, linear


def _two_episodes() -> RolloutTree:
    tree = RolloutTree()
    linear(tree, [{}, {}, {"terminated": True}])  # ids 0 1 2
    linear(tree, [{}, {}, {"terminated": True}])  # ids 3 4 5
    return tree


def test_contrastive_decay_spreads_branch_points_over_paths_and_depths():
    tree = _two_episodes()
    points = list(contrastive_branch_points([tree], path_decay=0.5, node_decay=0.5))
    # all weigh 1: node 0 first; then 1 (path split once) and 3 (depth 0 taken)
    # weigh 0.5 while 4 weighs 1; then 1 weighs 0.25 and 3 weighs 0.5
    assert points == [(0, 0), (0, 4), (0, 3), (0, 1)]
    # without decay the order is by depth then id
    assert list(contrastive_branch_points([tree], 1.0, 1.0)) == [(0, 0), (0, 3), (0, 1), (0, 4)]
    # path decay alone never branches the same trajectory twice in a row
    assert list(contrastive_branch_points([tree], 0.5, 1.0))[:2] == [(0, 0), (0, 3)]


def test_contrastive_plans_branches_within_budget_and_records_prefix_groups():
    trees = [_two_episodes(), _two_episodes()]
    alloc = Contrastive(ContrastiveOptions(k=2))
    state = AllocState(trees, Budget(9), spent=4, round=1)  # 5 leaves left
    reqs = alloc.plan(state)
    # per tree the first pick weighs 1; after it task 1's node 0 still weighs 1
    assert reqs == [Branch(0, 0, 2, reason="contrastive"), Branch(1, 0, 2, reason="contrastive"),
                    Branch(0, 4, 1, reason="contrastive")]
    engine = FakeEngine(lengths=[3, 3])
    for r in reqs:
        engine.apply(state, r)
    state.round = 2
    assert alloc.plan(state) == []
    assert trees[0].meta["prefix_groups"] == [
        {"node": 0, "leaves": [2, 7, 9]}, {"node": 4, "leaves": [5, 10]}]
    assert trees[1].meta["prefix_groups"] == [{"node": 0, "leaves": [2, 7, 9]}]


def test_prefix_groups_lists_leaves_below_each_branch_point():
    tree = RolloutTree()
    linear(tree, [{}, {}])  # 0 -> 1
    tree.add(Node(terminated=True), 0)  # 2
    tree.add(Node(terminated=True), 1)  # 3
    tree.add(Node(terminated=True), 1)  # 4
    assert prefix_groups(tree) == [{"node": 0, "leaves": [2, 3, 4]}, {"node": 1, "leaves": [3, 4]}]
