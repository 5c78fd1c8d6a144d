"""Plan steps and tree readings that several allocators share.

Reading: a turn's per-token values (partial nodes above a turn hold its first
tokens), the mean of their head, a tree's turns and leaves per task. Planning:
fresh episodes spread over the tasks with the fewest leaves, the top-up rounds
of a turns or tokens budget (estimates can leave budget unspent; after its own
rounds an allocator tops that up with fresh episodes for at most
``TOP_UP_ROUNDS`` more rounds, bounded because an episode that fails at reset
spends nothing; a leaves budget is met exactly and needs no top-up), and
``OpenThenBranch``, the two-round plan of the branching allocators.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from ...allocator_options import ContrastiveOptions, EntropyBranchOptions, KeyStateOptions
from ...types import Node, RolloutTree
from .base import (
    TOP_UP_ROUNDS,
    AllocState,
    Branch,
    Fresh,
    Request,
    affordable_leaves,
    budget_estimate,
    continuation_cost,
    fill_evenly,
    fresh_costs,
    leaf_cost,
    priced_fill,
)

__all__ = [
    "OpenThenBranch",
    "branch_from",
    "fresh_spread",
    "head_mean",
    "leaf_counts",
    "node_entropies",
    "node_top1",
    "opening_round",
    "priced_spread",
    "top_up",
    "turn_values",
    "turns",
]


# --------------------------------------------------------------------------- reading trees


def turn_values(tree: RolloutTree, node: Node, values: Callable[[Node], list[float]]) -> list[float]:
    """Per-token ``values`` of ``node``'s whole turn: partial nodes right above
    it hold the turn's first tokens (a segment fork inside the action)."""
    return [v for n in tree.turn_nodes(node.id) for v in values(n)]


def head_mean(values: list[float], n: int) -> float | None:
    head = values[:n]
    return sum(head) / len(head) if head else None


def node_entropies(node: Node) -> list[float]:
    return node.entropies


def node_top1(node: Node) -> list[float]:
    return node.top1


def turns(tree: RolloutTree) -> list[Node]:
    return [n for n in tree.nodes.values() if not n.partial]


def leaf_counts(state: AllocState) -> list[int]:
    return [len(t.leaves()) for t in state.trees]


# --------------------------------------------------------------------------- shared plan steps


def fresh_spread(
    state: AllocState, leaves: int, reason: str, counts: list[int] | None = None
) -> list[Request]:
    """``leaves`` fresh episodes, each to the task with the fewest leaves."""
    got = fill_evenly(leaf_counts(state) if counts is None else counts, leaves)
    return [Fresh(task, n, reason=reason) for task, n in enumerate(got) if n > 0]


def top_up(state: AllocState, own_rounds: int, est_leaf_cost: float | None = None) -> list[Request]:
    """After an allocator's ``own_rounds`` rounds: what a turns or tokens
    budget still affords, as fresh episodes, for ``TOP_UP_ROUNDS`` rounds; each
    to the task with the fewest leaves, priced by that task's episodes
    (``fresh_costs``: a long task's cost more than the mean)."""
    if state.budget.unit == "leaves" or state.round >= own_rounds + TOP_UP_ROUNDS:
        return []
    return priced_spread(state, budget_estimate(state, est_leaf_cost)[0], "top-up", est_leaf_cost)


def priced_spread(state: AllocState, units: float, reason: str,
                  est_leaf_cost: float | None = None) -> list[Request]:
    """Fresh episodes for ``units`` of a turns or tokens budget, each to the task with the fewest
    leaves, priced by that task's episodes (``fresh_costs``, ``priced_fill``)."""
    got = priced_fill(leaf_counts(state), units, fresh_costs(state, est_leaf_cost))
    return [Fresh(task, n, reason=reason) for task, n in enumerate(got) if n > 0]


def opening_round(state: AllocState, leaves: int, fraction: float, reason: str) -> list[Request]:
    """Round 0 of the branching allocators: ``fraction`` of the budget as fresh
    episodes, at least one per task (nothing to branch from otherwise)."""
    n = min(leaves, max(len(state.trees), math.floor(fraction * leaves + 1e-9)))
    return fresh_spread(state, n, reason)


def branch_from(
    state: AllocState, points: Iterable[tuple[int, int | None] | tuple[int, int, int]], k: int, leaves: int,
    reason: str, est_leaf_cost: float | None = None
) -> tuple[list[Request], int, float]:
    """``k`` continuations from each branch point (task, node id), in order,
    until ``leaves`` are spent. A point is the state after its node; None is
    the state after the reset, where only the prompt exists: that gives ``k``
    fresh episodes. A point (task, node id, m) forks inside the node's action
    after its first m tokens (``Branch.at_token``). A point met twice is
    branched once. Returns the requests, the leaves left and the budget left
    (in a leaves budget the two are one).

    In a turns or tokens budget each continuation is priced by its point
    (``continuation_cost``), out of the budget that ``leaves`` fresh episodes
    would cost, and the leaves left are what the rest of it buys fresh; the
    first point that no longer fits ends the plan."""
    out: list[Request] = []
    seen: set[tuple[int, int | None, int | None]] = set()
    priced = state.budget.unit != "leaves"
    units, per_leaf = budget_estimate(state, est_leaf_cost) if priced else (float(leaves), 1.0)
    units = min(units, leaves * per_leaf)  # what the caller gave: ``leaves`` fresh episodes
    for task, node_id, *at in points:
        at_token = at[0] if at else None
        if units < 1.0:
            break
        if (task, node_id, at_token) in seen:
            continue
        seen.add((task, node_id, at_token))
        cost = (per_leaf if node_id is None or not priced
                else continuation_cost(state, task, node_id, at_token, est_leaf_cost))
        n = min(k, int(units // cost))
        if n <= 0:
            break
        req: Request = (Fresh(task, n, reason=reason) if node_id is None
                        else Branch(task, node_id, n, at_token=at_token, reason=reason))
        units -= cost * leaf_cost(state.trees[task], req) if not priced else cost * n
        out.append(req)
    return out, int(units // per_leaf + 1e-9), units


class OpenThenBranch:
    """The plan the branching allocators share; a subclass ranks the branch points.

    Round 0 spends ``fresh_fraction`` of the budget on fresh episodes, at least
    one per task. Round 1 branches ``k`` ways from each point
    ``_branch_points`` yields, best first, until the budget is spent; what no
    point takes goes to fresh episodes. Later rounds only top up a turns or
    tokens budget (``top_up``). ``state.report[name]`` gets the points
    branched from, how many, and the leaves left to fresh episodes, besides
    what ``_branch_points`` writes there.
    """

    OWN_ROUNDS: ClassVar[int] = 2  # the opening round and the branch round; top-ups follow
    branch_reason: ClassVar[str]
    leftover_reason: ClassVar[str]

    name: ClassVar[str]
    options: EntropyBranchOptions | KeyStateOptions | ContrastiveOptions

    def plan(self, state: AllocState) -> list[Request]:
        o = self.options
        leaves = affordable_leaves(state, o.est_leaf_cost)
        if state.round == 0:
            return opening_round(state, leaves, o.fresh_fraction, "fresh")
        if state.round >= self.OWN_ROUNDS or leaves <= 0:
            return top_up(state, self.OWN_ROUNDS, o.est_leaf_cost)
        report = state.report.setdefault(self.name, {})
        out, left, units = branch_from(state, self._branch_points(state, report), o.k, leaves,
                                       self.branch_reason, o.est_leaf_cost)
        # in turns or tokens, what is left buys fresh episodes priced by their tasks: the mean
        # episode sent a long task's at a short one's price
        fresh = (fresh_spread(state, left, self.leftover_reason) if state.budget.unit == "leaves"
                 else priced_spread(state, units, self.leftover_reason, o.est_leaf_cost))
        report.update(branches=len(out), fresh_leftover=sum(r.n for r in fresh if isinstance(r, Fresh)),
                      branch_points=[(r.task, r.node if isinstance(r, Branch) else None) for r in out])
        return out + fresh

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> Iterable[tuple[int, int | None] | tuple[int, int, int]]:
        """The ranking hook: branch points (task, node id; None: the prompt),
        best first. May add what it found to ``report``."""
        raise NotImplementedError

    def _fork(self, tree: RolloutTree, task: int, node_id: int, values: Callable[[Node], list[float]],
              worst: Callable[..., int]) -> tuple[int, int | None] | tuple[int, int, int]:
        """Where to branch for the turn ending at ``node_id``: the state before it; with
        ``in_turn``, inside it, before the ``worst`` of its first ``first_tokens`` token values
        (a segment fork: the only branch a single-turn task has but the prompt). The
        first token itself is worst: the state before the turn. Only for options with
        ``first_tokens`` and ``in_turn`` (contrastive never forks inside a turn)."""
        o: Any = self.options
        node = tree.nodes[node_id]
        head = values(node)[:o.first_tokens]
        if o.in_turn and head and not node.partial:
            m = worst(range(len(head)), key=head.__getitem__)
            if 0 < m < len(node.action_ids):
                return task, node_id, m
        return task, tree.turn_parent(node_id)
