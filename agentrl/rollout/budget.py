"""One job: keep the books of a run's rollout budget: charge each request and turn, never overspend.

A budget counts leaves, turns or generated tokens (``Budget`` in
``agentrl.rollout.allocators``). Leaves are charged when a request is admitted,
whole (a request that would overspend is clipped to what is left); turns and
tokens are charged by each turn before its request goes out, and a turn that
generates fewer tokens than it reserved gets the rest back (a result with more
than it reserved is refused, failing its episode: ``checked_result`` in
``agentrl.rollout.episodes``, so nothing is charged past it). A turn that does
not fit what is left waits while other turns' reservations are in flight, so
reservations alone never end a tokens budget.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..types import RolloutTree
from .allocators import Branch, Budget, Fresh, is_open, leaf_cost

__all__ = ["BudgetMeter", "BudgetSpent", "planned_episodes"]


class BudgetSpent(Exception):
    """A path that would start after the budget is spent: nothing is recorded."""


class BudgetMeter:
    """The spending of one run against ``budget`` (None: unlimited)."""

    def __init__(self, budget: Budget | None = None):
        self.budget = budget
        self.spent = 0  # what is charged, reservations of turns in flight included
        self._out = 0  # tokens reserved by turns in flight, not yet settled (``refund``)
        self._waiters: list[asyncio.Future[None]] = []
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

    async def has_room(self) -> bool:
        """Whether a path may start: a turn can still be charged once the turns in flight have
        given back what they reserved and did not generate (their reservations alone do not
        spend a tokens budget)."""
        b = self.budget
        if b is None or b.unit == "leaves":
            return True
        while self.spent >= b.total and self._out > 0:
            await self._settled()
        return self.spent < b.total

    async def reserve(self, tokens: int) -> int:
        """Charge one turn of up to ``tokens`` tokens; returns the tokens allowed (0: spent).

        In a tokens budget a turn that does not fit what is left waits while other turns'
        reservations are in flight: with a backend that serves requests together, the first
        few turns reserved the whole budget, and the others were cut at 0 tokens while it
        was still to be given back. With none in flight it gets what is left."""
        b = self.budget
        if b is None or b.unit == "leaves":
            return tokens
        if b.unit == "turns":
            if self.spent >= b.total:
                return 0
            self.spent += 1
            return tokens
        while b.total - self.spent < tokens and self._out > 0:
            await self._settled()
        allowed = min(tokens, b.total - self.spent)
        if allowed <= 0:
            return 0
        self.spent += allowed
        self._out += allowed
        return allowed

    def refund(self, reserved: int, used: int) -> None:
        """Settle a turn: give back what it reserved and did not generate (token budgets only)."""
        if self.budget is not None and self.budget.unit == "tokens" and reserved > 0:
            self.spent -= reserved - used
            self._out -= reserved
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def _settled(self) -> None:
        """Until a turn in flight settles."""
        w = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        await w

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


def planned_episodes(rollout: Any, tasks: int) -> int:
    """The episodes ``agentrl.rollout.collect`` plays for ``tasks`` tasks under ``rollout`` (a
    ``RolloutConfig``), which a progress bar counts to (a training step's, ``agentrl rollout``'s): a leaves budget's total (its default is
    ``tasks * group_size``), or fewer where ``independent``'s ``n`` per task caps it. The bar was
    made for ``tasks * group_size`` whatever ``rollout.budget`` said. A turns or tokens budget
    is not known in episodes until they have played: ``tasks * group_size`` is its estimate, and
    ``segment_tree`` counts each paused segment of a path, so its bar passes the total."""
    leaves = rollout.budget if rollout.budget and rollout.budget_unit == "leaves" else tasks * rollout.group_size
    a = rollout.allocator
    if a.name == "independent" and a.n != "all":
        return min(leaves, tasks * (rollout.group_size if a.n is None else a.n))
    return leaves
