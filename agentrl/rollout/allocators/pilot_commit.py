"""Pilot, then commit: a few pilot episodes per task, then the budget where pilots disagree.

After AR3PO (Zhang et al. 2025, arXiv:2509.25808: more rollouts to prompts
still unsolved, fewer to solved ones) and AERO's skipping of prompts whose
pilots all agree.

Rule (``pilot_commit_split``): a task's share of the committed budget is
proportional to the Bernoulli variance ``p (1 - p)`` of its pilots' pass rate
p, the chance that two of its episodes disagree, i.e. that its GRPO group has
a nonzero advantage. Saturated tasks (p in {0, 1}) get only ``min_per_task``.

Plan: round 0 starts ``pilots`` episodes per task; round 1 commits the rest of
the budget by the split (in a turns or tokens budget, as many episodes as fit
when each is priced by its task's pilots, ``fresh_costs``); later rounds only
top up a turns or tokens budget.
Simplified: one pilot round, no response reuse, no refill of groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ...allocator_options import PilotCommitOptions
from ...types import RolloutTree
from .base import (
    AllocState,
    Fresh,
    Request,
    affordable_leaves,
    budget_estimate,
    fill_evenly,
    fresh_costs,
    is_open,
    largest_remainder,
    most_leaves,
)
from .shared import top_up

__all__ = ["PilotCommit", "pilot_commit_split"]


def pilot_commit_split(
    p: Sequence[float | None], total: int, min_per_task: int = 0
) -> tuple[list[int], int]:
    """Split ``total`` leaves over tasks by their pilot pass rates ``p``: in
    proportion to ``p (1 - p)``, a saturated task (p in {0, 1}) only
    ``min_per_task``, a task without pilots (p None) as p = 1/2.

    Returns (leaves per task, skipped): ``skipped`` is what the saturated tasks
    would have had under an even split of ``total`` minus what they got. When
    every task is saturated nothing is preferred and the split is even.
    """
    n = len(p)
    saturated = [q is not None and q in (0.0, 1.0) for q in p]
    floor = fill_evenly([0] * n, total, [min_per_task if s else 0 for s in saturated])
    rest = total - sum(floor)
    weights = [0.0 if s else 0.25 if q is None else q * (1.0 - q)
               for q, s in zip(p, saturated, strict=True)]
    extra = largest_remainder(weights, rest) if sum(weights) > 0 else fill_evenly(floor, rest)
    alloc = [a + b for a, b in zip(floor, extra, strict=True)]
    even = fill_evenly([0] * n, total)
    skipped = sum(max(e - a, 0) for e, a, s in zip(even, alloc, saturated, strict=True) if s)
    return alloc, skipped


def _pass_rate(tree: RolloutTree) -> float | None:
    """Fraction of finished episodes that succeeded; None without any. An
    episode that failed outside the policy (``error`` set) is not counted."""
    ends = [leaf for leaf in tree.leaves() if not is_open(leaf) and leaf.error is None]
    return sum(leaf.success for leaf in ends) / len(ends) if ends else None


@dataclass(frozen=True)
class PilotCommit:
    """Pilots, then the remaining budget split by their pass rates. Reports the
    pass rates, the split and ``skipped_budget`` in ``state.report["pilot_commit"]``."""

    options: PilotCommitOptions = field(default_factory=PilotCommitOptions)

    name: ClassVar[str] = "pilot_commit"
    needs_snapshots: ClassVar[bool] = False
    top_logprobs: ClassVar[int] = 0

    def plan(self, state: AllocState) -> list[Request]:
        o = self.options
        leaves = affordable_leaves(state, o.est_leaf_cost)
        tasks = len(state.trees)
        if state.round == 0:
            got = fill_evenly([0] * tasks, leaves, [o.pilots] * tasks)
            return [Fresh(task, n, reason="pilot") for task, n in enumerate(got) if n > 0]
        if state.round > 1:  # round 0 pilots, round 1 commits
            return top_up(state, 2, o.est_leaf_cost)
        p = [_pass_rate(t) for t in state.trees]
        if state.budget.unit != "leaves":  # the commit goes to some tasks: priced by theirs
            leaves = sum(most_leaves(lambda n: pilot_commit_split(p, n, o.min_per_task)[0],
                                     fresh_costs(state, o.est_leaf_cost),
                                     budget_estimate(state, o.est_leaf_cost)[0]))
        alloc, skipped = pilot_commit_split(p, leaves, o.min_per_task)
        state.report[self.name] = {"p": p, "commit": alloc, "skipped_budget": skipped}
        return [Fresh(task, n, reason="commit") for task, n in enumerate(alloc) if n > 0]
