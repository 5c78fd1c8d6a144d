"""Segment trees: every task grows a fixed-width tree of turn segments (TreePO).

Li et al. 2025, "TreePO: Bridging the Gap of Policy Optimization and Efficacy
and Inference Efficiency with Heuristic Tree-based Modeling": every task grows
a tree of ``segment_turns``-turn segments, ``depth`` levels deep, each open
leaf splitting ``width`` ways; a full tree has ``width ** depth`` leaves (the
first level is ``width`` fresh episodes: the prompt is the first branch point).

Plan: the budget gives each task a target number of leaves (even split). Round
0 starts ``ceil(target / width ** (depth - 1))`` episodes per task; round r
(< depth) continues every open leaf, splitting as late as the width allows
(``segment_children``). The last level, or a subtree that needs no more
splits, runs to the end. A branch that finishes before the last level leaves
part of its target unspent: each round that budget goes back, first to other
tasks' open leaves (as far as their trees can still grow), the rest to fresh
episodes, so a leaves budget is met exactly.

Simplified: segments end at turn boundaries, not after a fixed number of
tokens; no early stop of segments by heuristic scores; no reuse of fallback
paths across batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...allocator_options import SegmentTreeOptions
from .base import AllocState, Branch, Fresh, Request, affordable_leaves, fill_evenly, is_open
from .shared import fresh_spread, leaf_counts, top_up

__all__ = ["SegmentTree", "segment_children"]


def segment_children(open_leaves: int, extra: int, rest: int, width: int) -> int:
    """Children the ``open_leaves`` of a segment tree get this round, so that
    the ``rest`` levels after it (each splitting at most ``width`` ways) can
    still reach ``open_leaves + extra`` leaves: the fewest that allow it, at
    least one each, at most ``width`` each. Branching as late as the width
    allows keeps a partial tree shaped like the bottom of TreePO's full tree."""
    need = math.ceil((open_leaves + extra) / width**rest)
    return max(open_leaves, min(open_leaves * width, need))


@dataclass(frozen=True)
class SegmentTree:
    """TreePO-style segment trees (see the module docstring)."""

    options: SegmentTreeOptions = field(default_factory=SegmentTreeOptions)

    name: ClassVar[str] = "segment_tree"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 0

    def plan(self, state: AllocState) -> list[Request]:
        o = self.options
        leaves = affordable_leaves(state, o.est_leaf_cost)
        report = state.report.setdefault(self.name, {"targets": [], "given_back": 0})
        if state.round == 0:
            targets = fill_evenly([0] * len(state.trees), leaves)
            report["targets"] = targets
            out: list[Request] = []
            for task, target in enumerate(targets):
                roots = math.ceil(target / o.width ** (o.depth - 1))
                if roots:
                    paused = o.segment_turns if roots < target else None
                    out.append(Fresh(task, roots, max_turns=paused, reason="segment"))
            return out
        return self._grow(state, leaves, report)

    def _grow(self, state: AllocState, leaves: int, report: dict[str, Any]) -> list[Request]:
        o = self.options
        level = state.round  # the level the children of this round's branches form
        rest = max(o.depth - 1 - level, 0)  # levels still to split after this one
        open_leaves = [[n for n in t.leaves() if is_open(n)] for t in state.trees]
        # Most leaves each task's tree can still add: every open leaf fully split.
        growth = o.width ** (o.depth - level) - 1 if level < o.depth else 0
        counts = leaf_counts(state)
        extra = fill_evenly(counts, leaves, [len(op) * growth for op in open_leaves])
        out: list[Request] = []
        for task, (opened, e) in enumerate(zip(open_leaves, extra, strict=True)):
            if not opened:
                continue
            m = segment_children(len(opened), e, rest, o.width)
            paused = o.segment_turns if rest > 0 and m < len(opened) + e else None
            for j, leaf in enumerate(opened):
                k = m // len(opened) + (j < m % len(opened))
                out.append(Branch(task, leaf.id, k, max_turns=paused, reason="segment"))
        if level >= o.depth and not out:
            return top_up(state, o.depth, o.est_leaf_cost)
        # Past every open leaf's growth: budget of finished branches (and, in
        # turns or tokens, what the estimate left) goes to fresh episodes.
        given_back = leaves - sum(extra) if level < o.depth else 0
        report["given_back"] += given_back
        totals = [c + e for c, e in zip(counts, extra, strict=True)]
        return out + fresh_spread(state, given_back, "given back by early finish", totals)
