"""Key-state branching: branch at decision states, where the policy had no clear favourite (Spark).

After Spark (Wu et al. 2026, arXiv:2601.20209: branch only at critical states,
within a fixed budget). Rule (``key_states``): a turn is a key state when the
mean top-1 probability of its first ``first_tokens`` action tokens is below
``top1_threshold``.

Plan (``OpenThenBranch``): round 0 spends ``fresh_fraction`` of the budget on
fresh episodes; round 1 branches ``k`` ways from the state before each key
state, lowest top-1 probability first, until the budget is spent; the rest
goes to fresh episodes. ``in_turn``: fork inside the key turn instead, before
its lowest top-1 token among the first ``first_tokens``; this is what branches
a single-turn task, whose only state before a turn is the prompt.

Simplified: Spark finds critical states from an explore signal the agent
writes in its reasoning; we use the policy's own low top-1 probability
instead, which needs ``top_logprobs = 1`` from the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...allocator_options import KeyStateOptions
from ...types import RolloutTree
from .base import AllocState
from .shared import OpenThenBranch, head_mean, node_top1, turn_values, turns

__all__ = ["KeyState", "key_states"]


def key_states(
    tree: RolloutTree, first_tokens: int = 4, top1_threshold: float = 0.5
) -> list[tuple[float, int]]:
    """Decision turns: (mean top-1 probability, node id), lowest first. Turns
    without ``Node.top1`` are skipped."""
    out = []
    for node in turns(tree):
        mean = head_mean(turn_values(tree, node, node_top1), first_tokens)
        if mean is not None and mean < top1_threshold:
            out.append((mean, node.id))
    return sorted(out)


@dataclass(frozen=True)
class KeyState(OpenThenBranch):
    """Branch before (or inside) the turns with the lowest top-1 probability."""

    options: KeyStateOptions = field(default_factory=KeyStateOptions)

    name: ClassVar[str] = "key_state"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 1
    branch_reason: ClassVar[str] = "key state"
    leftover_reason: ClassVar[str] = "no key state left"

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> list[tuple[int, int | None] | tuple[int, int, int]]:
        o = self.options
        ranked = []
        for task, tree in enumerate(state.trees):
            ranked += [(p, task, node_id) for p, node_id in key_states(tree, o.first_tokens, o.top1_threshold)]
        report["candidates"] = len(ranked)
        # without top-1 probabilities (a backend that ignored top_logprobs) nothing is a key state
        report["top1_seen"] = any(n.top1 for t in state.trees for n in t.nodes.values())
        return [self._fork(state.trees[task], task, node_id, node_top1, min) for _, task, node_id in sorted(ranked)]
