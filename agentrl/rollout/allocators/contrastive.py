"""Contrastive branching: branch points spread over paths and depths by decay (CBPO).

After CBPO's contrastive branching (the decay rule below is our own reading;
it was not checked against the paper's equations). A candidate turn v (not
done, no error) weighs

    w(v) = path_decay ** b_path(v) * node_decay ** b_depth(v)

with b_path(v) the branch points on the path from the root to v (v included):
how often that trajectory was already split, and b_depth(v) the branch points
at v's depth (its turn index) in its tree. Each pick counts as a branch point
for the next ones, so picks move to other trajectories and other depths
(``contrastive_branch_points``).

Plan (``OpenThenBranch``): round 0 spends ``fresh_fraction`` of the budget on
fresh episodes; round 1 branches ``k`` ways from the points ranked first,
until the budget is spent (the rest to fresh episodes). When the run ends
(``finish``, which the engine calls however the run ends, and the last, empty
plan) ``prefix_groups`` goes into every tree's ``meta["prefix_groups"]`` for
credit assignment. Deterministic: no sampling, so no seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...allocator_options import ContrastiveOptions
from ...types import Node, RolloutTree
from .base import AllocState, Request
from .shared import OpenThenBranch, turns

__all__ = ["Contrastive", "contrastive_branch_points", "prefix_groups"]


def _top_down(tree: RolloutTree) -> list[Node]:
    """Every node after its parent. Ids do not promise that: a segment fork
    puts a new partial node above older ones."""
    order = [tree.nodes[r] for r in tree.roots]
    for node in order:  # grows while it is read: breadth first
        order += [tree.nodes[c] for c in node.children]
    return order


def _turn_index(tree: RolloutTree) -> dict[int, int]:
    """{node id: turns before it}; a partial node shares its turn's index."""
    index: dict[int, int] = {}
    for node in _top_down(tree):
        parent = None if node.parent is None else tree.nodes[node.parent]
        index[node.id] = 0 if parent is None else index[parent.id] + (not parent.partial)
    return index


def _branch_weights(
    tree: RolloutTree, picked: set[int], path_decay: float, node_decay: float
) -> dict[int, tuple[float, int]]:
    """{candidate id: (weight, depth)} for one tree; see the module docstring."""
    depth = _turn_index(tree)

    def is_point(n: Node) -> bool:
        return len(n.children) >= 2 or n.id in picked

    on_path: dict[int, int] = {}
    per_depth: dict[int, int] = {}
    for node in _top_down(tree):
        above = 0 if node.parent is None else on_path[node.parent]
        on_path[node.id] = above + is_point(node)
        per_depth[depth[node.id]] = per_depth.get(depth[node.id], 0) + is_point(node)
    return {
        n.id: (path_decay ** on_path[n.id] * node_decay ** per_depth[depth[n.id]], depth[n.id])
        for n in turns(tree)
        if not n.done and n.error is None and n.id not in picked
    }


def contrastive_branch_points(
    trees: Sequence[RolloutTree], path_decay: float = 0.5, node_decay: float = 0.5
) -> Iterator[tuple[int, int]]:
    """Branch points (task, node id), best first, spread over paths and depths.

    Greedy and deterministic: the highest weight ``w(v)``, then the lowest
    (depth, task, node id), so equal weights spread over tasks too. Yields
    lazily, until every candidate was picked.
    """
    picked: list[set[int]] = [set() for _ in trees]

    def best(task: int) -> tuple[tuple[float, int, int, int], int] | None:
        weights = _branch_weights(trees[task], picked[task], path_decay, node_decay)
        keyed = [((-w, d, task, nid), nid) for nid, (w, d) in weights.items()]
        return min(keyed, default=None)

    bests = {task: best(task) for task in range(len(trees))}
    while True:
        live = [b for b in bests.values() if b is not None]
        if not live:
            return
        key, node_id = min(live)
        task = key[2]
        picked[task].add(node_id)
        yield task, node_id
        bests[task] = best(task)


def _leaves_under(tree: RolloutTree, node_id: int) -> list[int]:
    stack, out = [node_id], []
    while stack:
        node = tree.nodes[stack.pop()]
        if node.children:
            stack.extend(node.children)
        else:
            out.append(node.id)
    return sorted(out)


def prefix_groups(tree: RolloutTree) -> list[dict[str, Any]]:
    """Exact-prefix groups: ``{"node": id, "leaves": [leaf ids]}`` for every
    node with two or more children. The leaves below such a node share its
    whole prefix (tokens and env state) and part ways right after it, so their
    returns differ only by what was sampled after it: the contrastive groups of
    CBPO-style credit. Roots share only the prompt; that group is the whole
    task, which group baselines already cover."""
    return [
        {"node": n.id, "leaves": _leaves_under(tree, n.id)}
        for n in tree.nodes.values()
        if len(n.children) >= 2
    ]


@dataclass(frozen=True)
class Contrastive(OpenThenBranch):
    """Branch from the points ``contrastive_branch_points`` ranks first; ``finish`` (and the
    last, empty plan) writes ``prefix_groups`` into every tree's meta."""

    options: ContrastiveOptions = field(default_factory=ContrastiveOptions)

    name: ClassVar[str] = "contrastive"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 0
    branch_reason: ClassVar[str] = "contrastive"
    leftover_reason: ClassVar[str] = "no branch point left"

    def plan(self, state: AllocState) -> list[Request]:
        out = super().plan(state)
        if not out:
            self.finish(state)
        return out

    def finish(self, state: AllocState) -> None:
        """Write each tree's ``prefix_groups``. Only the last, empty plan wrote them: a run that
        ended another way (interrupted, or a round the engine admitted nothing of) kept none."""
        for tree in state.trees:
            tree.meta["prefix_groups"] = prefix_groups(tree)

    def _branch_points(self, state: AllocState, report: dict[str, Any]) -> Iterator[tuple[int, int]]:
        # lazy: each point is ranked after the picks before it, and few are taken
        return contrastive_branch_points(state.trees, self.options.path_decay, self.options.node_decay)
