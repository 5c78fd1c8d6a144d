"""Entropy branching: branch before the turns whose entropy rose (ARPO, AEPO).

ARPO (Dong et al. 2025, arXiv:2507.19849, entropy-based adaptive rollout):
the score of a turn is ``H_t - H_initial``, the mean entropy of its first
``first_tokens`` action tokens minus the same for the episode's first turn.
AEPO (Dong et al. 2025, "Agentic Entropy-Balanced Policy Optimization"): a
turn whose previous turn also scored above ``threshold`` has its score
multiplied by ``penalty``, so branching does not pile up along one path. A
negative score (a fall in entropy, kept under a negative ``threshold``) is
lowered by the same share, ``score - (1 - penalty) * |score|``: multiplying
it would raise it.
Kept: turns whose score after the penalty exceeds ``threshold``
(``entropy_branch_scores``).

Plan (``OpenThenBranch``): round 0 spends ``fresh_fraction`` of the budget on
fresh episodes; round 1 branches ``k`` ways from the state before each chosen
turn, highest score first, until the budget is spent; what no turn earns goes
to fresh episodes. ``in_turn``: fork inside the chosen turn instead, before
its highest-entropy token among the first ``first_tokens`` (ARPO branches at
the token level too).

Simplified: ARPO normalises the rise and branches at random with probability
alpha + beta * dH; we rank the scores instead. AEPO's penalty grows with the
run of high-entropy turns; ours is one fixed factor. The split between rounds
is fixed, where AEPO sets it from an entropy pre-monitoring pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...allocator_options import EntropyBranchOptions
from ...types import RolloutTree
from .base import AllocState
from .shared import OpenThenBranch, head_mean, node_entropies, turn_values, turns

__all__ = ["EntropyBranch", "entropy_branch_scores"]


def entropy_branch_scores(
    tree: RolloutTree, first_tokens: int = 8, threshold: float = 0.5, penalty: float = 0.5
) -> dict[int, float]:
    """Turns worth branching before, by their rise in entropy: {node id: score}
    (the rule of the module docstring)."""
    raw: dict[int, float] = {}
    first_of: dict[int, int] = {}  # node id -> its episode's first turn; shared along a path
    baseline: dict[int, float | None] = {}  # first turn id -> H_initial
    for node in turns(tree):
        if tree.turn_parent(node.id) is None:
            continue  # a first turn is the baseline itself
        first = tree.nodes[_first_turn(tree, node.id, first_of)]
        if first.id not in baseline:
            baseline[first.id] = head_mean(turn_values(tree, first, node_entropies), first_tokens)
        h_t = head_mean(turn_values(tree, node, node_entropies), first_tokens)
        h_0 = baseline[first.id]
        if h_t is not None and h_0 is not None:
            raw[node.id] = h_t - h_0
    scores = {}
    for node_id, score in raw.items():
        before = tree.turn_parent(node_id)
        if before in raw and raw[before] > threshold:
            score -= (1.0 - penalty) * abs(score)  # = score * penalty when score > 0
        if score > threshold:
            scores[node_id] = score
    return scores


def _first_turn(tree: RolloutTree, node_id: int, memo: dict[int, int]) -> int:
    """The id of the first non-partial node from the root down to ``node_id``, remembered for
    every node walked, so that all of a tree's turns cost one walk (a walk from each to its
    root was quadratic: a chain of 20,000 turns took 18 s)."""
    walked = []
    cur: int | None = node_id
    while cur is not None and cur not in memo:
        walked.append(cur)
        cur = tree.nodes[cur].parent
    found = memo[cur] if cur is not None else None
    for nid in reversed(walked):  # root side first: the topmost non-partial node wins
        if found is None and not tree.nodes[nid].partial:
            found = nid
        if found is not None:
            memo[nid] = found
    assert found is not None, "a turn's path holds a non-partial node: the turn itself"
    return found


@dataclass(frozen=True)
class EntropyBranch(OpenThenBranch):
    """Branch before (or inside) the turns whose entropy rose most."""

    options: EntropyBranchOptions = field(default_factory=EntropyBranchOptions)

    name: ClassVar[str] = "entropy_branch"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 0
    branch_reason: ClassVar[str] = "entropy rise"
    leftover_reason: ClassVar[str] = "no high-entropy turn left"

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> list[tuple[int, int | None] | tuple[int, int, int]]:
        o = self.options
        ranked = []
        for task, tree in enumerate(state.trees):
            scores = entropy_branch_scores(tree, o.first_tokens, o.threshold, o.penalty)
            ranked += [(-score, task, node_id) for node_id, score in scores.items()]
        report["candidates"] = len(ranked)
        return [self._fork(state.trees[task], task, node_id, node_entropies, max)
                for _, task, node_id in sorted(ranked)]
