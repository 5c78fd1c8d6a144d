"""Independent episodes: n fresh episodes per task, in one round (GRPO's sampling).

Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Sec. 4.1: a group is n
episodes of one task, sampled independently from the prompt.

Plan: round 0 starts ``n`` episodes per task, or spreads the whole budget
evenly over the tasks when ``n`` is ``"all"`` (or None: ``rollout_allocator``
makes that ``rollout.group_size`` for a configured allocator); a budget smaller than ``n`` per task
is spread evenly too, the remainder to the first tasks. A turns or tokens
budget gets top-up rounds, never past ``n`` per task, each episode priced by its
task's finished ones (``fresh_costs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ...allocator_options import IndependentOptions
from .base import (
    TOP_UP_ROUNDS,
    AllocState,
    Fresh,
    Request,
    affordable_leaves,
    budget_estimate,
    fill_evenly,
    fresh_costs,
    priced_fill,
)
from .shared import leaf_counts

__all__ = ["Independent"]


@dataclass(frozen=True)
class Independent:
    """GRPO's sampling: ``options.n`` independent episodes per task (see the module docstring)."""

    options: IndependentOptions = field(default_factory=IndependentOptions)

    name: ClassVar[str] = "independent"
    needs_snapshots: ClassVar[bool] = False
    top_logprobs: ClassVar[int] = 0

    def plan(self, state: AllocState) -> list[Request]:
        n = None if self.options.n == "all" else self.options.n
        if state.round >= 1 + TOP_UP_ROUNDS or (state.round > 0 and state.budget.unit == "leaves"):
            return []
        est = self.options.est_leaf_cost
        counts = leaf_counts(state)
        caps = None if n is None else [max(n - c, 0) for c in counts]
        if state.budget.unit == "leaves":
            got = fill_evenly(counts, affordable_leaves(state, est), caps)
        else:  # each task's episodes priced by its own (a long task's cost more than the mean)
            got = priced_fill(counts, budget_estimate(state, est)[0], fresh_costs(state, est), caps)
        state.report[self.name] = {"per_task": [c + g for c, g in zip(counts, got, strict=True)]}
        return [Fresh(task, n, reason="independent") for task, n in enumerate(got) if n > 0]
