"""One job: keep the books of a run's rollout budget: charge each request and turn, never overspend.

A budget counts leaves, turns or generated tokens (``Budget`` in
``agentrl.rollout.allocators``). Leaves are charged when a request is admitted,
whole (a request that would overspend is clipped to what is left); turns and
tokens are charged by each turn before its request goes out, and a turn that
generates fewer tokens than it reserved gets the rest back.
"""

from __future__ import annotations

from typing import Any

from ..types import RolloutTree
from .allocators import Branch, Budget, Fresh, is_open, leaf_cost

__all__ = ["BudgetMeter", "BudgetSpent"]


class BudgetSpent(Exception):
    """A path that would start after the budget is spent: nothing is recorded."""


class BudgetMeter:
    """The spending of one run against ``budget`` (None: unlimited)."""

    def __init__(self, budget: Budget | None = None):
        self.budget = budget
        self.spent = 0
        self._continued: set[tuple[int, int]] = set()  # (id(tree), open leaf) a request continues

    @staticmethod
    def _continues(tree: RolloutTree, req: Fresh | Branch) -> tuple[int, int] | None:
        """The open leaf a turn branch continues, as a key; None for other requests."""
        if isinstance(req, Branch) and req.at_token is None and is_open(tree.nodes[req.node]):
            return id(tree), req.node
        return None

    def exhausted(self) -> bool:
        """Whether no turn can be charged any more (a leaf budget is spent by admitting requests)."""
        b = self.budget
        return b is not None and b.unit != "leaves" and self.spent >= b.total

    def reason(self) -> str:
        return f"budget: {self.budget.total} {self.budget.unit} spent"  # type: ignore[union-attr]

    def admit(self, tree: RolloutTree, req: Fresh | Branch, report: dict[str, Any]) -> Fresh | Branch | None:
        """The part of a request the budget allows (charged now for leaves); None when nothing fits."""
        b = self.budget
        if b is None:
            return req
        if b.unit == "leaves":
            # an open leaf becomes internal once: only the first branch from it saves a leaf
            key = self._continues(tree, req)
            again = int(key is not None and key in self._continued)
            req = clip(tree, req, b.total - self.spent - again, report)  # type: ignore[assignment]
            if req is not None:
                self.spent += leaf_cost(tree, req) + again
                if key is not None:
                    self._continued.add(key)
            return req
        return None if self.spent >= b.total else req

    def reserve(self, tokens: int) -> int:
        """Charge one turn of up to ``tokens`` tokens; returns the tokens allowed (0: spent)."""
        b = self.budget
        if b is None or b.unit == "leaves":
            return tokens
        left = b.total - self.spent
        if left <= 0:
            return 0
        if b.unit == "turns":
            self.spent += 1
            return tokens
        self.spent += min(tokens, left)
        return min(tokens, left)

    def refund(self, reserved: int, used: int) -> None:
        """Give back what a turn reserved and did not generate (token budgets only)."""
        if self.budget is not None and self.budget.unit == "tokens":
            self.spent -= reserved - used


def clip(tree: RolloutTree, req: Fresh | Branch, left: int, report: dict[str, Any]) -> Fresh | Branch | None:
    """Shrink a request to the leaves left (never overspend); None when nothing fits."""
    over = leaf_cost(tree, req) - left
    if over <= 0:
        return req
    report["clipped_leaves"] = report.get("clipped_leaves", 0) + over
    if isinstance(req, Fresh):
        return Fresh(req.task, req.n - over, req.max_turns, req.reason) if req.n > over else None
    k = req.k - over
    return Branch(req.task, req.node, k, req.at_token, req.max_turns, req.reason) if k >= 1 else None
