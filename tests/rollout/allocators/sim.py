"""A simulated engine for allocator tests: scripted turns, requests applied as the engine does."""

from __future__ import annotations

from agentrl.rollout.allocators import Allocator, AllocState, Budget, Fresh, leaf_cost
from agentrl.types import Node, RolloutTree


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
