"""Branch allocators: hand-computed plans, budget limits, and a simulated engine loop."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.rollout.allocation import (
    ALLOCATORS,
    Allocator,
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
    contrastive_branch_points,
    entropy_branch_scores,
    fill_evenly,
    is_open,
    key_states,
    largest_remainder,
    leaf_cost,
    make_allocator,
    pilot_commit_split,
    prefix_groups,
    segment_children,
)
from agentrl.rollout.tree import split_node
from agentrl.types import Node, RolloutTree

# --------------------------------------------------------------------------- a fake engine


class FakeEngine:
    """Applies requests to trees as the engine does, with scripted turns.

    Task i's episodes last ``lengths[i]`` turns. A finished episode succeeds
    when ``succeed(task, j)`` says so, j counting the task's finished episodes.
    Turn t of an episode has entropies ``entropy(t)`` and top-1 probabilities
    ``top1(t)``. ``max_turns`` pauses an episode as an open leaf.
    """

    def __init__(self, lengths, succeed=lambda task, j: j % 2 == 0,
                 entropy=lambda t: [0.2 + 0.7 * t] * 3, top1=lambda t: [0.9 - 0.3 * t] * 3):
        self.lengths, self.succeed, self.entropy, self.top1 = lengths, succeed, entropy, top1
        self.finished = [0] * len(lengths)
        self.turns_used = 0

    def episode(self, tree: RolloutTree, task: int, parent: int | None, max_turns: int | None):
        turn = 0 if parent is None else len(tree.path(parent))
        played = 0
        while True:
            last = turn == self.lengths[task] - 1
            node = Node(action_ids=[7, 8, 9], entropies=self.entropy(turn), top1=self.top1(turn))
            if last:
                node.terminated = True
                node.reward = float(self.succeed(task, self.finished[task]))
                self.finished[task] += 1
            parent = tree.add(node, parent).id
            self.turns_used += 1
            played += 1
            turn += 1
            if last:
                return
            if max_turns is not None and played >= max_turns:
                node.open = True
                return

    def apply(self, state: AllocState, req) -> None:
        tree = state.trees[req.task]
        if isinstance(req, Fresh):
            for _ in range(req.n):
                self.episode(tree, req.task, None, req.max_turns)
            return
        node = tree.nodes[req.node]
        assert not node.done, "branched from a finished episode"
        node.open = False
        for _ in range(req.k):
            self.episode(tree, req.task, req.node, req.max_turns)


def drive(alloc: Allocator, engine: FakeEngine, budget: Budget, max_rounds: int = 20) -> AllocState:
    """Run ``alloc`` to the end; every round must fit the remaining budget."""
    state = AllocState(trees=[RolloutTree() for _ in engine.lengths], budget=budget)
    while state.round < max_rounds:
        reqs = alloc.plan(state)
        if not reqs:
            return state
        if budget.unit == "leaves":
            cost = sum(leaf_cost(state.trees[r.task], r) for r in reqs)
            assert cost <= state.remaining, f"round {state.round} planned {cost} > {state.remaining}"
            state.spent += cost
        for r in reqs:
            engine.apply(state, r)
        if budget.unit == "turns":
            state.spent = engine.turns_used
        state.round += 1
    raise AssertionError(f"{alloc.name} still planning after {max_rounds} rounds")


def total_leaves(state: AllocState) -> int:
    return sum(len(t.leaves()) for t in state.trees)


def linear(tree: RolloutTree, turns: list[dict], parent: int | None = None) -> list[int]:
    """Add one episode, turn by turn (Node fields per turn); returns node ids."""
    ids = []
    for fields_ in turns:
        parent = tree.add(Node(**fields_), parent).id
        ids.append(parent)
    return ids


ALL = [
    Independent(),
    PilotCommit(pilots=2, min_per_task=1),
    EntropyBranch(threshold=0.5),
    SegmentTree(depth=3, width=2),
    KeyState(top1_threshold=0.5),
    Contrastive(),
]

# --------------------------------------------------------------------------- budget arithmetic


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


# --------------------------------------------------------------------------- independent


def test_independent_spreads_a_small_budget_and_never_overspends():
    state = AllocState([RolloutTree() for _ in range(3)], Budget(10))
    reqs = Independent(n=4).plan(state)
    assert [(r.task, r.n) for r in reqs] == [(0, 4), (1, 3), (2, 3)]
    state = AllocState([RolloutTree() for _ in range(3)], Budget(2))
    assert [(r.task, r.n) for r in Independent(n=4).plan(state)] == [(0, 1), (1, 1)]


def test_independent_n_none_reaches_the_budget_and_n_caps_it():
    state = AllocState([RolloutTree() for _ in range(3)], Budget(20))
    assert [r.n for r in Independent().plan(state)] == [7, 7, 6]
    state = AllocState([RolloutTree() for _ in range(3)], Budget(20))
    assert [r.n for r in Independent(n=4).plan(state)] == [4, 4, 4]
    state.round = 1
    assert Independent(n=4).plan(state) == []


# --------------------------------------------------------------------------- pilot-commit


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
    alloc = PilotCommit(pilots=4, min_per_task=1)
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
    reqs = PilotCommit(pilots=2).plan(state)
    assert sum(r.n for r in reqs) == 4
    assert [r.n for r in reqs] == [2, 1, 1]


# --------------------------------------------------------------------------- entropy branch


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
    alloc = EntropyBranch(first_tokens=2, threshold=0.5, penalty=0.5, k=2)
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
    assert [r.n for r in EntropyBranch(fresh_fraction=0.5).plan(state)] == [2, 2, 1]
    state = AllocState([RolloutTree() for _ in range(3)], Budget(4))
    assert [r.n for r in EntropyBranch(fresh_fraction=0.5).plan(state)] == [1, 1, 1]  # one per task


# --------------------------------------------------------------------------- segment tree


def test_segment_children_branches_as_late_as_width_allows():
    assert segment_children(2, 8, 2, 2) == 3  # 10 leaves in 2 more levels: 3 now
    assert segment_children(3, 7, 1, 2) == 5
    assert segment_children(5, 5, 0, 2) == 10
    assert segment_children(4, 0, 2, 2) == 4  # nothing more to add: one child each


def test_segment_tree_full_tree_has_width_to_the_depth_leaves():
    engine = FakeEngine(lengths=[10, 10])
    state = drive(SegmentTree(depth=3, width=2), engine, Budget(16))
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
    alloc = SegmentTree(depth=3, width=2)
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
    state = drive(SegmentTree(depth=3, width=2), engine, Budget(12))
    assert [len(t.leaves()) for t in state.trees] == [8, 4]
    assert state.report["segment_tree"]["targets"] == [6, 6]
    assert state.report["segment_tree"]["given_back"] == 2


# --------------------------------------------------------------------------- key state


def test_key_state_branches_before_the_lowest_top1_turn():
    tree = RolloutTree()
    a = linear(tree, [{"top1": [0.9, 0.9]}, {"top1": [0.3, 0.5, 0.1, 0.1, 0.0]},
                      {"top1": [0.45], "terminated": True}])
    b = linear(tree, [{"top1": [0.2, 0.4]}, {"top1": [0.9], "terminated": True}])
    assert key_states(tree, first_tokens=4, top1_threshold=0.5) == [
        pytest.approx((0.25, a[1])), pytest.approx((0.3, b[0])), pytest.approx((0.45, a[2]))]
    state = AllocState([tree], Budget(7), spent=2, round=1)
    reqs = KeyState(k=2, first_tokens=4).plan(state)
    # a1 -> from a0; b0 is a first turn -> fresh episodes; a2 -> from a1 (1 leaf left)
    assert reqs == [Branch(0, a[0], 2, reason="key state"), Fresh(0, 2, reason="key state"),
                    Branch(0, a[1], 1, reason="key state")]
    assert state.report["key_state"] == {"candidates": 3, "top1_seen": True, "branches": 3,
                                         "fresh_leftover": 0,
                                         "branch_points": [(0, a[0]), (0, None), (0, a[1])]}
    assert KeyState.top_logprobs == 1 and KeyState.needs_snapshots


# --------------------------------------------------------------------------- contrastive


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
    alloc = Contrastive(k=2)
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


# --------------------------------------------------------------------------- the whole loop


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


# --------------------------------------------------------------------------- registry


def test_registry_builds_every_allocator_by_name():
    assert set(ALLOCATORS) == {"independent", "pilot_commit", "entropy_branch", "segment_tree",
                               "key_state", "contrastive"}
    for name, cls in ALLOCATORS.items():
        alloc = make_allocator(name)
        assert isinstance(alloc, cls) and isinstance(alloc, Allocator)
        assert alloc.name == name
    assert make_allocator("independent", n=3).n == 3


def test_make_allocator_names_unknown_allocators_and_options():
    with pytest.raises(ValueError, match=r"unknown allocator 'pilot-commit' \(did you mean 'pilot_commit'\?\).*independent"):
        make_allocator("pilot-commit")
    with pytest.raises(ConfigError, match=r"unknown option 'widht'; valid options: depth, width"):
        make_allocator("segment_tree", widht=3)
    with pytest.raises(ConfigError, match=r"allocator entropy_branch: option 'fresh_fraction' must be in \(0, 1\]"):
        make_allocator("entropy_branch", fresh_fraction=0.0)
    with pytest.raises(ConfigError, match="'k' must be >= 1"):
        Contrastive(k=0)


# --------------------------------------------------------------------------- segment forks


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
    reqs = EntropyBranch(first_tokens=2, k=2).plan(state)
    assert reqs[0] == Branch(0, a[0], 2, reason="entropy rise")  # both turns start after a0: once
    assert all(not (isinstance(r, Branch) and r.node == a[0]) for r in reqs[1:])
    # the fork counts as a branch point at turn 1: a1 weighs 0.5 (path) * 0.5 (depth)
    assert list(contrastive_branch_points([tree])) == [(0, a[0]), (0, a[1])]
    assert prefix_groups(tree) == [{"node": part.id, "leaves": [a[2], q.id]}]


def test_key_state_in_turn_forks_a_single_turn_task_inside_the_turn():
    tree = RolloutTree()
    (a,) = linear(tree, [{"action_ids": [1, 2, 3, 4], "top1": [0.6, 0.1, 0.3, 0.9], "terminated": True}])
    (b,) = linear(tree, [{"action_ids": [5, 6], "top1": [0.2, 0.4], "terminated": True}])
    state = AllocState([tree], Budget(6), spent=2, round=1)
    # b's most uncertain token is its first: the state before it is the prompt -> fresh episodes;
    # a's is token 1 -> fork after a's first token
    assert KeyState(k=2, first_tokens=4, in_turn=True).plan(state) == [
        Fresh(0, 2, reason="key state"), Branch(0, a, 2, at_token=1, reason="key state")]
    # turn-level, a single-turn task has nothing to branch before but the prompt
    turn_level = KeyState(k=2, first_tokens=4).plan(AllocState([tree], Budget(6), spent=2, round=1))
    assert not any(isinstance(r, Branch) for r in turn_level)
    with pytest.raises(ConfigError, match="in_turn"):
        KeyState(in_turn="yes")
