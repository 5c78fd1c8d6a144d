"""The allocator contract: requests, the state an allocator sees, and the budget arithmetic.

An allocator is sans-I/O. The engine asks it for a plan in rounds:
``plan(state)`` looks at the trees grown so far and returns requests
(``Fresh`` episodes of a task, or ``Branch``es from a node); the engine runs
them, charges what they cost to ``state.spent`` and asks again, until the
allocator returns no request.

Leaf accounting: ``Fresh(n)`` adds n leaves. ``Branch(node, k)`` adds k leaves,
or k - 1 when ``node`` is an open leaf (one paused by ``max_turns``, see
``is_open``), because that leaf becomes internal.

Budgets in turns or tokens: allocators plan in leaves. ``affordable_leaves``
divides what is left by the mean cost of an episode so far (the turns, or the
action tokens, on its root-to-leaf path), or by the allocator's
``est_leaf_cost`` before any episode has finished. An open leaf is already a
leaf, but it spends more when it is continued: the cost it is expected to
reach less what it has spent is kept back first. A branch is priced by what
the finished episodes through its point spent after it
(``continuation_cost``), not by the mean episode: branch points sit in long
episodes. Fresh episodes sent to given tasks (top-ups, ``independent``'s fill,
``pilot_commit``'s commit) are priced by each task's own finished episodes
(``fresh_costs``, ``priced_fill``): tasks differ in length. The engine stops
episodes at the real limit.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from ...types import Node, RolloutTree

__all__ = [
    "DEFAULT_LEAF_COST",
    "TOP_UP_ROUNDS",
    "AllocState",
    "Allocator",
    "Branch",
    "Budget",
    "BudgetUnit",
    "Fresh",
    "Request",
    "affordable_leaves",
    "budget_estimate",
    "continuation_cost",
    "fill_evenly",
    "fresh_costs",
    "is_open",
    "largest_remainder",
    "leaf_cost",
    "most_leaves",
    "priced_fill",
]

BudgetUnit = Literal["leaves", "turns", "tokens"]


@dataclass(slots=True, frozen=True)
class Budget:
    """What one batch may spend: ``total`` leaves (episodes), turns or generated tokens."""

    total: int
    unit: BudgetUnit = "leaves"

    def __post_init__(self) -> None:
        # Budget(8, "episodes") was charged per token (every unit but leaves and turns was)
        units = get_args(BudgetUnit)
        if self.unit not in units:
            raise ValueError(f"budget unit {self.unit!r} is none of {', '.join(units)}")
        if isinstance(self.total, bool) or not isinstance(self.total, numbers.Integral):
            raise ValueError(f"budget total {self.total!r} is not a whole number")
        if self.total < 0:
            raise ValueError(f"budget total {self.total} is negative")
        object.__setattr__(self, "total", int(self.total))  # a numpy one is written as JSON


@dataclass(slots=True)
class Fresh:
    """Start ``n`` new episodes of task ``task`` (new roots of its tree).

    ``max_turns`` pauses each after that many turns, leaving an open leaf to
    branch from later (segment trees); None runs to the end.
    """

    task: int
    n: int = 1
    max_turns: int | None = None
    reason: str = ""


@dataclass(slots=True)
class Branch:
    """Sample ``k`` continuations from ``node`` of task ``task``'s tree.

    ``at_token=None``: from the state after ``node``'s env step (turn-level).
    ``at_token=m``: fork inside ``node``'s action after its first m tokens
    (segment-level); the k continuations share those m tokens, and ``node`` is
    split into a partial node holding them plus its old remainder.
    ``max_turns`` pauses each continuation after that many turns.
    """

    task: int
    node: int
    k: int = 1
    at_token: int | None = None
    max_turns: int | None = None
    reason: str = ""


Request = Fresh | Branch


@dataclass(slots=True)
class AllocState:
    """What an allocator sees: one tree per task, the budget and what is spent."""

    trees: list[RolloutTree]
    budget: Budget
    spent: int = 0
    round: int = 0
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return max(self.budget.total - self.spent, 0)


@runtime_checkable
class Allocator(Protocol):
    """Plans requests in rounds; returns ``[]`` when done.

    ``needs_snapshots``: the engine keeps a branch point (env snapshot plus
    context) after every turn, so ``Branch`` can start from any node.
    ``top_logprobs``: how many top-k logprobs per token the backend returns
    (``Node.top1`` gets the top-1 probability of each action token).
    An allocator may also define ``finish(state)``: the engine calls it once when
    the run ends, however it ends (the last plan, a round it admitted nothing of,
    an interruption), to write what it keeps in the trees' meta.
    """

    name: str
    needs_snapshots: bool
    top_logprobs: int

    def plan(self, state: AllocState) -> list[Request]: ...


def is_open(node: Node) -> bool:
    """A leaf paused by ``max_turns``: not done, no children, more turns to play."""
    return not node.children and not node.done and node.open


def leaf_cost(tree: RolloutTree, request: Request) -> int:
    """Leaves a request adds to ``tree`` (see the module docstring)."""
    if isinstance(request, Fresh):
        return request.n
    node = tree.nodes[request.node]
    return request.k - 1 if request.at_token is None and is_open(node) else request.k


# --------------------------------------------------------------------------- budget arithmetic

DEFAULT_LEAF_COST: dict[str, float] = {"leaves": 1.0, "turns": 8.0, "tokens": 1024.0}
"""Cost of one leaf, per budget unit, before any episode has finished (``est_leaf_cost``)."""

TOP_UP_ROUNDS = 2
"""Rounds of fresh episodes that spend what estimates left of a turns or tokens budget."""


def fill_evenly(counts: Sequence[int], total: int, caps: Sequence[int] | None = None) -> list[int]:
    """Hand out ``total`` units one at a time, each to the slot with the fewest
    ``counts[i]`` plus units so far (lowest index on ties), never more than
    ``caps[i]`` to slot i. Returns the units per slot; they sum to less than
    ``total`` only where the caps bind. With all counts 0 this is the even split
    with the remainder to the first slots."""
    added = [0] * len(counts)
    heap = [(c, i) for i, c in enumerate(counts) if caps is None or caps[i] > 0]
    heapq.heapify(heap)
    for _ in range(max(total, 0)):
        if not heap:
            break
        c, i = heapq.heappop(heap)
        added[i] += 1
        if caps is None or added[i] < caps[i]:
            heapq.heappush(heap, (c + 1, i))
    return added


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Whole numbers proportional to ``weights`` that sum exactly to ``total``
    (Hamilton's method): each gets the floor of its quota ``total * w / sum(w)``,
    then the units left go one each to the largest remainders (lowest index on
    ties). All-zero weights get nothing."""
    mass = sum(weights)
    if total <= 0 or mass <= 0:
        return [0] * len(weights)
    quotas = [total * w / mass for w in weights]
    out = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (out[i] - quotas[i], i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def _path_cost(tree: RolloutTree, leaf: Node, unit: BudgetUnit) -> int:
    path = tree.path(leaf.id)
    if unit == "turns":
        return sum(not n.partial for n in path)
    return sum(len(n.action_ids) for n in path)


def budget_estimate(state: AllocState, est_leaf_cost: float | None) -> tuple[float, float]:
    """(budget left for new leaves, expected cost of a new episode), in a turns or tokens
    budget's unit; see ``affordable_leaves``."""
    unit = state.budget.unit
    done, paused = [], []
    for tree in state.trees:
        for leaf in tree.leaves():
            if leaf.done:
                done.append(_path_cost(tree, leaf, unit))
            elif is_open(leaf):
                paused.append(_path_cost(tree, leaf, unit))
    guess = est_leaf_cost or DEFAULT_LEAF_COST[unit]
    finished = sum(done) / len(done) if done else guess
    expected = [_open_leaf_cost(c, done, guess) for c in paused]
    per_leaf = (sum(done) + sum(expected)) / len(done + expected) if done or expected else finished
    to_come = sum(e - c for e, c in zip(expected, paused, strict=True))  # what continuing them spends
    return max(state.remaining - to_come, 0.0), max(per_leaf, 1.0)


def _open_leaf_cost(spent: int, done: list[int], guess: float) -> float:
    """What an episode paused after ``spent`` is expected to cost in all: the mean of the
    finished episodes that cost more than that (it is known to go on), or ``guess`` when none
    did; at least one more than it has spent. The mean of all finished episodes priced a
    long task's open leaf by the short tasks that had finished first (1 more turn for a
    10-turn episode paused at 2, as the only finished episode took 2)."""
    longer = [c for c in done if c > spent]
    return max(spent + 1.0, sum(longer) / len(longer) if longer else guess)


def affordable_leaves(state: AllocState, est_leaf_cost: float | None = None) -> int:
    """How many more leaves the remaining budget buys, in the budget's unit.

    ``leaves``: exactly ``state.remaining`` (an open leaf is a leaf already).
    ``turns``/``tokens``: an episode's cost is the turns, or action tokens, on
    its root-to-leaf path. A finished one costs what it did; an open one
    (``is_open``) is expected to cost what the finished ones that went past
    its point cost on average, or ``est_leaf_cost`` (default
    ``DEFAULT_LEAF_COST``) when none did, and at least one more than it has
    spent. The remaining budget, less what
    the open leaves are expected to spend still, is divided by the mean
    expected cost. This prices fresh episodes; a branch is priced by where it
    starts (``continuation_cost``).
    """
    if state.budget.unit == "leaves":
        return state.remaining
    left, per_leaf = budget_estimate(state, est_leaf_cost)
    return int(left // per_leaf)


def fresh_costs(state: AllocState, est_leaf_cost: float | None = None) -> list[float]:
    """Expected cost of one more fresh episode of each task, in a turns or tokens budget: the
    mean of the task's own finished episodes where it has any, else the mean episode over all
    tasks (``budget_estimate``); at least 1. The mean over all priced every task alike: fresh
    episodes sent to a long task (the fewest leaves, a pilot's disagreement) cost several
    times it, and the budget cut them. Failed episodes are left out of a task's own mean: one
    that failed at reset cost nothing, and priced so its task took one episode per unit left."""
    unit, default = state.budget.unit, budget_estimate(state, est_leaf_cost)[1]
    out = []
    for tree in state.trees:
        done = [_path_cost(tree, leaf, unit) for leaf in tree.leaves() if leaf.done and leaf.error is None]
        out.append(max(sum(done) / len(done), 1.0) if done else default)
    return out


def priced_fill(counts: Sequence[int], units: float, costs: Sequence[float],
                caps: Sequence[int] | None = None) -> list[int]:
    """``fill_evenly`` with a price: one episode at a time to the slot with the fewest
    ``counts[i]`` plus episodes so far (lowest index on ties), each costing ``costs[i]`` of
    ``units``; a slot whose next episode no longer fits what is left, or that reached
    ``caps[i]``, gets no more. Returns the episodes per slot."""
    if bad := [c for c in costs if not c > 0]:
        raise ValueError(f"episode costs must be > 0, got {bad[0]!r}")
    added = [0] * len(counts)
    heap = [(c, i) for i, c in enumerate(counts) if caps is None or caps[i] > 0]
    heapq.heapify(heap)
    while heap:
        c, i = heapq.heappop(heap)
        if costs[i] > units + 1e-9:  # does not fit: closed, cheaper slots go on
            continue
        units -= costs[i]
        added[i] += 1
        if caps is None or added[i] < caps[i]:
            heapq.heappush(heap, (c + 1, i))
    return added


def most_leaves(split: Callable[[int], list[int]], costs: Sequence[float], units: float) -> list[int]:
    """``split(n)`` (episodes per task for n in all) for the largest n whose episodes, each
    priced by its task's ``costs``, fit ``units`` (a bisection; ``split(0)`` is all zeros)."""
    def cost(n: int) -> float:
        return sum(k * c for k, c in zip(split(n), costs, strict=True))

    lo, hi = 0, int(units // min(costs)) if costs else 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= units + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    return split(lo)


def _spent_before(tree: RolloutTree, node: Node, at_token: int | None, unit: BudgetUnit) -> int:
    """What a path has spent at a branch point: after ``node``'s turn, or ``at_token`` tokens into
    its action (the turn itself is then still to play)."""
    if at_token is None:
        return _path_cost(tree, node, unit)
    if node.parent is None:
        return at_token if unit == "tokens" else 0
    return _path_cost(tree, tree.nodes[node.parent], unit) + (at_token if unit == "tokens" else 0)


def continuation_cost(state: AllocState, task: int, node_id: int, at_token: int | None = None,
                      est_leaf_cost: float | None = None) -> float:
    """Expected spend of one more continuation from a branch point (after ``node_id``'s turn,
    or ``at_token`` tokens into its action) in a turns or tokens budget: the mean, over the
    finished episodes through the point, of what they spent after it (at least 1); the cost of
    a fresh episode (``affordable_leaves``) when none has finished. 1 for a leaves budget.

    The mean fresh episode priced branches before: branch points sit in the long episodes
    (a short one has few turns to branch before), so continuing from them cost several times
    that, and a branch round planned more than its budget."""
    unit = state.budget.unit
    if unit == "leaves":
        return 1.0
    tree = state.trees[task]
    node = tree.nodes[node_id]
    before = _spent_before(tree, node, at_token, unit)
    after: list[int] = []
    stack = [(node, _path_cost(tree, node, unit) - before)]
    while stack:  # the finished leaves below the point, with what they spent after it
        n, spent = stack.pop()
        if not n.children and n.done:
            after.append(spent)
        for c in n.children:
            child = tree.nodes[c]
            stack.append((child, spent + (not child.partial if unit == "turns" else len(child.action_ids))))
    if not after:
        return budget_estimate(state, est_leaf_cost)[1]
    return max(sum(after) / len(after), 1.0)
