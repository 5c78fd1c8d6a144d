"""Branch allocation: where a fixed rollout budget goes, across tasks, turns and tokens.

An allocator is sans-I/O. The engine (``agentrl.rollout.engine``) asks it for a
plan in rounds: ``plan(state)`` looks at the trees grown so far and returns
requests (``Fresh`` episodes of a task, or ``Branch``es from a node). The
engine runs them all, charges what they cost to ``state.spent`` and asks again,
until the allocator returns no request. The engine enforces the budget: a
``leaves`` request that would overspend is clipped, and ``turns``/``tokens``
budgets stop episodes when spent (truncation reason ``budget``), so no
allocator can overspend even when its estimates are wrong.

Leaf accounting: ``Fresh(n)`` adds n leaves. ``Branch(node, k)`` adds k leaves,
or k - 1 when ``node`` is an open leaf (one paused by ``max_turns``, see
``is_open``), because that leaf becomes internal.

Budgets in turns or tokens: allocators plan in leaves. ``affordable_leaves``
divides what is left by the mean cost of a finished episode so far (the turns,
or the action tokens, on its root-to-leaf path), or by the allocator's
``est_leaf_cost`` before any episode has finished. A path counts its shared
prefix again, so the estimate is high for branches: plans stay under the
budget, and the engine stops episodes at the real limit. Estimates can also
leave budget unspent; after its own rounds an allocator tops that up with
fresh episodes for at most ``TOP_UP_ROUNDS`` more rounds (bounded, because an
episode that fails at reset spends nothing). A leaves budget is met exactly
and needs no top-up.

The allocators, chosen by name from ``ALLOCATORS``:

    independent     n fresh episodes per task (GRPO)
    pilot_commit    pilots, then the rest in proportion to p(1-p) (AR3PO, AERO)
    entropy_branch  branch before turns whose entropy rose (ARPO, AEPO)
    segment_tree    fixed-width tree of turn segments (TreePO)
    key_state       branch before turns with a low top-1 probability (Spark)
    contrastive     branch points spread by path and depth decay (CBPO)

Each one reads only the trees and the budget; the state it keeps between
rounds lives in the trees (``state.round`` says where it is), so one allocator
object serves every batch. What an allocator decided goes to
``state.report[name]``.
"""

from __future__ import annotations

import difflib
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from ..errors import ConfigError
from ..types import Node, RolloutTree

__all__ = [
    "ALLOCATORS",
    "AllocState",
    "Allocator",
    "Branch",
    "Budget",
    "Contrastive",
    "EntropyBranch",
    "Fresh",
    "Independent",
    "KeyState",
    "PilotCommit",
    "SegmentTree",
    "affordable_leaves",
    "contrastive_branch_points",
    "entropy_branch_scores",
    "fill_evenly",
    "is_open",
    "key_states",
    "largest_remainder",
    "leaf_cost",
    "make_allocator",
    "pilot_commit_split",
    "prefix_groups",
    "segment_children",
]

BudgetUnit = Literal["leaves", "turns", "tokens"]


@dataclass(slots=True, frozen=True)
class Budget:
    """What one batch may spend: ``total`` leaves (episodes), turns or generated tokens."""

    total: int
    unit: BudgetUnit = "leaves"


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


def pilot_commit_split(
    p: Sequence[float | None], total: int, min_per_task: int = 0
) -> tuple[list[int], int]:
    """Split ``total`` leaves over tasks by their pilot pass rates ``p``.

    After AR3PO (Zhang et al. 2025, arXiv:2509.25808: more rollouts to prompts
    still unsolved, fewer to solved ones) and AERO's skipping of prompts whose
    pilots all agree: a task's share is proportional to the Bernoulli variance
    ``p (1 - p)``, the chance that two of its episodes disagree, i.e. that its
    GRPO group has a nonzero advantage. Saturated tasks (p in {0, 1}) get only
    ``min_per_task``; a task without pilots (p None) counts as p = 1/2.
    Simplified: one pilot round, no response reuse, no refill of groups.

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


def segment_children(open_leaves: int, extra: int, rest: int, width: int) -> int:
    """Children the ``open_leaves`` of a segment tree get this round, so that
    the ``rest`` levels after it (each splitting at most ``width`` ways) can
    still reach ``open_leaves + extra`` leaves: the fewest that allow it, at
    least one each, at most ``width`` each. Branching as late as the width
    allows keeps a partial tree shaped like the bottom of TreePO's full tree."""
    need = math.ceil((open_leaves + extra) / width**rest)
    return max(open_leaves, min(open_leaves * width, need))


def _path_cost(tree: RolloutTree, leaf: Node, unit: BudgetUnit) -> int:
    path = tree.path(leaf.id)
    if unit == "turns":
        return sum(not n.partial for n in path)
    return sum(len(n.action_ids) for n in path)


def affordable_leaves(state: AllocState, est_leaf_cost: float | None = None) -> int:
    """How many more leaves the remaining budget buys, in the budget's unit.

    ``leaves``: exactly ``state.remaining``. ``turns``/``tokens``: remaining
    divided by the mean cost of the finished episodes so far (turns, or action
    tokens, on the root-to-leaf path), or by ``est_leaf_cost`` (default
    ``DEFAULT_LEAF_COST``) before any has finished. A branch re-uses its
    prefix, so this over-estimates its cost and the plan stays in budget.
    """
    unit = state.budget.unit
    if unit == "leaves":
        return state.remaining
    costs = [_path_cost(t, leaf, unit) for t in state.trees for leaf in t.leaves() if leaf.done]
    per_leaf = sum(costs) / len(costs) if costs else (est_leaf_cost or DEFAULT_LEAF_COST[unit])
    return int(state.remaining // max(per_leaf, 1.0))


# --------------------------------------------------------------------------- reading trees


def _turn_values(
    tree: RolloutTree, node: Node, values: Callable[[Node], list[float]]
) -> list[float]:
    """Per-token ``values`` of ``node``'s whole turn: partial nodes right above
    it hold the turn's first tokens (a segment fork inside the action)."""
    return [v for n in tree.turn_nodes(node.id) for v in values(n)]


def _head_mean(values: list[float], n: int) -> float | None:
    head = values[:n]
    return sum(head) / len(head) if head else None


def _entropies(node: Node) -> list[float]:
    return node.entropies


def _top1(node: Node) -> list[float]:
    return node.top1


def _turns(tree: RolloutTree) -> list[Node]:
    return [n for n in tree.nodes.values() if not n.partial]


def _leaf_counts(state: AllocState) -> list[int]:
    return [len(t.leaves()) for t in state.trees]


def _pass_rate(tree: RolloutTree) -> float | None:
    """Fraction of finished episodes that succeeded; None without any. An
    episode that failed outside the policy (``error`` set) is not counted."""
    ends = [leaf for leaf in tree.leaves() if not is_open(leaf) and leaf.error is None]
    return sum(leaf.success for leaf in ends) / len(ends) if ends else None


def entropy_branch_scores(
    tree: RolloutTree, first_tokens: int = 8, threshold: float = 0.5, penalty: float = 0.5
) -> dict[int, float]:
    """Turns worth branching before, by their rise in entropy: {node id: score}.

    ARPO (Dong et al. 2025, arXiv:2507.19849, entropy-based adaptive rollout):
    the score of a turn is ``H_t - H_initial``, the mean entropy of its first
    ``first_tokens`` action tokens minus the same for the episode's first turn.
    AEPO (Dong et al. 2025, "Agentic Entropy-Balanced Policy Optimization"):
    a turn whose previous turn also scored above ``threshold`` has its score
    multiplied by ``penalty``, so branching does not pile up along one path.
    Kept: turns whose score after the penalty exceeds ``threshold``.
    Simplified: ARPO normalises the rise and branches at random with
    probability alpha + beta * dH; we rank the scores instead. AEPO's penalty
    grows with the run of high-entropy turns; ours is one fixed factor.
    """
    raw: dict[int, float] = {}
    for node in _turns(tree):
        if tree.turn_parent(node.id) is None:
            continue  # a first turn is the baseline itself
        first = next(n for n in tree.path(node.id) if not n.partial)
        h_t = _head_mean(_turn_values(tree, node, _entropies), first_tokens)
        h_0 = _head_mean(_turn_values(tree, first, _entropies), first_tokens)
        if h_t is not None and h_0 is not None:
            raw[node.id] = h_t - h_0
    scores = {}
    for node_id, score in raw.items():
        before = tree.turn_parent(node_id)
        if before in raw and raw[before] > threshold:
            score *= penalty
        if score > threshold:
            scores[node_id] = score
    return scores


def key_states(
    tree: RolloutTree, first_tokens: int = 4, top1_threshold: float = 0.5
) -> list[tuple[float, int]]:
    """Decision turns: (mean top-1 probability, node id), lowest first.

    A turn is a key state when the mean top-1 probability of its first
    ``first_tokens`` action tokens is below ``top1_threshold``: the policy had
    no clear favourite there. Turns without ``Node.top1`` are skipped.
    """
    out = []
    for node in _turns(tree):
        mean = _head_mean(_turn_values(tree, node, _top1), first_tokens)
        if mean is not None and mean < top1_threshold:
            out.append((mean, node.id))
    return sorted(out)


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
    """{candidate id: (weight, depth)} for one tree; see ``contrastive_branch_points``."""
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
        for n in _turns(tree)
        if not n.done and n.error is None and n.id not in picked
    }


def contrastive_branch_points(
    trees: Sequence[RolloutTree], path_decay: float = 0.5, node_decay: float = 0.5
) -> Iterator[tuple[int, int]]:
    """Branch points (task, node id), best first, spread over paths and depths.

    After CBPO's contrastive branching (the decay rule below is our own
    reading; it was not checked against the paper's equations). A candidate
    turn v (not done, no error) weighs

        w(v) = path_decay ** b_path(v) * node_decay ** b_depth(v)

    with b_path(v) the branch points on the path from the root to v (v
    included): how often that trajectory was already split, and b_depth(v) the
    branch points at v's depth (its turn index) in its tree. Each pick counts as a branch point
    for the next ones, so picks move to other trajectories and other depths.
    Greedy and deterministic: the highest weight, then the lowest (depth,
    task, node id), so equal weights spread over tasks too. Yields lazily,
    until every candidate was picked.
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


# --------------------------------------------------------------------------- shared plan steps


_RULES: dict[str, Callable[[Any], bool]] = {
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "None or >= 1": lambda v: v is None or v >= 1,
    "None or > 0": lambda v: v is None or v > 0,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "true or false": lambda v: isinstance(v, bool),
}


def _check(alloc: Any, **rules: str) -> None:
    """Raise ``ConfigError`` naming the first option of ``alloc`` that breaks its rule."""
    for key, rule in rules.items():
        value = getattr(alloc, key)
        try:
            ok = _RULES[rule](value)
        except TypeError:
            ok = False
        if not ok:
            raise ConfigError(
                f"allocator {alloc.name}: option {key!r} must be {rule}, got {value!r}"
            )


def _fresh_spread(
    state: AllocState, leaves: int, reason: str, counts: list[int] | None = None
) -> list[Request]:
    """``leaves`` fresh episodes, each to the task with the fewest leaves."""
    got = fill_evenly(_leaf_counts(state) if counts is None else counts, leaves)
    return [Fresh(task, n, reason=reason) for task, n in enumerate(got) if n > 0]


def _top_up(state: AllocState, leaves: int, own_rounds: int) -> list[Request]:
    """After an allocator's ``own_rounds`` rounds: what a turns or tokens
    budget still affords, as fresh episodes, for ``TOP_UP_ROUNDS`` rounds."""
    if state.budget.unit == "leaves" or state.round >= own_rounds + TOP_UP_ROUNDS:
        return []
    return _fresh_spread(state, leaves, "top-up")


def _opening_round(state: AllocState, leaves: int, fraction: float, reason: str) -> list[Request]:
    """Round 0 of the branching allocators: ``fraction`` of the budget as fresh
    episodes, at least one per task (nothing to branch from otherwise)."""
    n = min(leaves, max(len(state.trees), math.floor(fraction * leaves + 1e-9)))
    return _fresh_spread(state, n, reason)


def _branch_from(
    state: AllocState, points: Iterable[tuple[int, int | None] | tuple[int, int, int]], k: int, leaves: int,
    reason: str
) -> tuple[list[Request], int]:
    """``k`` continuations from each branch point (task, node id), in order,
    until ``leaves`` are spent. A point is the state after its node; None is
    the state after the reset, where only the prompt exists: that gives ``k``
    fresh episodes. A point (task, node id, m) forks inside the node's action
    after its first m tokens (``Branch.at_token``). A point met twice is
    branched once. Returns the requests and the leaves left."""
    out: list[Request] = []
    seen: set[tuple[int, int | None, int | None]] = set()
    for task, node_id, *at in points:
        at_token = at[0] if at else None
        if leaves <= 0:
            break
        if (task, node_id, at_token) in seen:
            continue
        seen.add((task, node_id, at_token))
        n = min(k, leaves)
        req: Request = (Fresh(task, n, reason=reason) if node_id is None
                        else Branch(task, node_id, n, at_token=at_token, reason=reason))
        leaves -= leaf_cost(state.trees[task], req)
        out.append(req)
    return out, leaves


class _OpenThenBranch:
    """The plan the branching allocators share; a subclass ranks the branch points.

    Round 0 spends ``fresh_fraction`` of the budget on fresh episodes, at least
    one per task. Round 1 branches ``k`` ways from each point
    ``_branch_points`` yields, best first, until the budget is spent; what no
    point takes goes to fresh episodes. Later rounds only top up a turns or
    tokens budget (``_top_up``). ``state.report[name]`` gets the points
    branched from, how many, and the leaves left to fresh episodes, besides
    what ``_branch_points`` writes there.
    """

    OWN_ROUNDS: ClassVar[int] = 2  # the opening round and the branch round; top-ups follow
    branch_reason: ClassVar[str]
    leftover_reason: ClassVar[str]

    name: ClassVar[str]
    k: int
    fresh_fraction: float
    est_leaf_cost: float | None
    first_tokens: int
    in_turn: bool

    def plan(self, state: AllocState) -> list[Request]:
        leaves = affordable_leaves(state, self.est_leaf_cost)
        if state.round == 0:
            return _opening_round(state, leaves, self.fresh_fraction, "fresh")
        if state.round >= self.OWN_ROUNDS or leaves <= 0:
            return _top_up(state, leaves, self.OWN_ROUNDS)
        report = state.report.setdefault(self.name, {})
        out, left = _branch_from(state, self._branch_points(state, report), self.k, leaves,
                                 self.branch_reason)
        report.update(branches=len(out), fresh_leftover=left,
                      branch_points=[(r.task, r.node if isinstance(r, Branch) else None) for r in out])
        return out + _fresh_spread(state, left, self.leftover_reason)

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> Iterable[tuple[int, int | None]]:
        """The ranking hook: branch points (task, node id; None: the prompt),
        best first. May add what it found to ``report``."""
        raise NotImplementedError

    def _fork(self, tree: RolloutTree, task: int, node_id: int, values: Callable[[Node], list[float]],
              worst: Callable[..., int]) -> tuple[int, int | None] | tuple[int, int, int]:
        """Where to branch for the turn ending at ``node_id``: the state before it; with
        ``in_turn``, inside it, before the ``worst`` of its first ``first_tokens`` token values
        (a segment fork: the only branch a single-turn task has but the prompt). The
        first token itself is worst: the state before the turn."""
        node = tree.nodes[node_id]
        head = values(node)[:self.first_tokens]
        if self.in_turn and head and not node.partial:
            m = worst(range(len(head)), key=head.__getitem__)
            if 0 < m < len(node.action_ids):
                return task, node_id, m
        return task, tree.turn_parent(node_id)


# --------------------------------------------------------------------------- allocators


@dataclass
class Independent:
    """GRPO's sampling (Shao et al. 2024, arXiv:2402.03300): ``n`` independent
    episodes per task in one round (turns or tokens budgets: plus top-up
    rounds, never past ``n`` per task). ``n=None`` spreads the whole budget
    evenly over the tasks; a budget smaller than ``n`` per task is spread
    evenly too, the remainder to the first tasks."""

    n: int | None = None
    est_leaf_cost: float | None = None

    name: ClassVar[str] = "independent"
    needs_snapshots: ClassVar[bool] = False
    top_logprobs: ClassVar[int] = 0

    def __post_init__(self) -> None:
        _check(self, n="None or >= 1", est_leaf_cost="None or > 0")

    def plan(self, state: AllocState) -> list[Request]:
        if state.round >= 1 + TOP_UP_ROUNDS or (state.round > 0 and state.budget.unit == "leaves"):
            return []
        leaves = affordable_leaves(state, self.est_leaf_cost)
        counts = _leaf_counts(state)
        caps = None if self.n is None else [max(self.n - c, 0) for c in counts]
        got = fill_evenly(counts, leaves, caps)
        state.report[self.name] = {"per_task": [c + g for c, g in zip(counts, got, strict=True)]}
        return [Fresh(task, n, reason="independent") for task, n in enumerate(got) if n > 0]


@dataclass
class PilotCommit:
    """Pilot, then commit: ``pilots`` episodes per task, then the remaining
    budget split by the pilots' pass rates (``pilot_commit_split``: AR3PO,
    AERO). Reports the pass rates, the split and ``skipped_budget`` in
    ``state.report["pilot_commit"]``."""

    pilots: int = 2
    min_per_task: int = 0
    est_leaf_cost: float | None = None

    name: ClassVar[str] = "pilot_commit"
    needs_snapshots: ClassVar[bool] = False
    top_logprobs: ClassVar[int] = 0

    def __post_init__(self) -> None:
        _check(self, pilots=">= 1", min_per_task=">= 0", est_leaf_cost="None or > 0")

    def plan(self, state: AllocState) -> list[Request]:
        leaves = affordable_leaves(state, self.est_leaf_cost)
        tasks = len(state.trees)
        if state.round == 0:
            got = fill_evenly([0] * tasks, leaves, [self.pilots] * tasks)
            return [Fresh(task, n, reason="pilot") for task, n in enumerate(got) if n > 0]
        if state.round > 1:  # round 0 pilots, round 1 commits
            return _top_up(state, leaves, 2)
        p = [_pass_rate(t) for t in state.trees]
        alloc, skipped = pilot_commit_split(p, leaves, self.min_per_task)
        state.report[self.name] = {"p": p, "commit": alloc, "skipped_budget": skipped}
        return [Fresh(task, n, reason="commit") for task, n in enumerate(alloc) if n > 0]


@dataclass
class EntropyBranch(_OpenThenBranch):
    """Branch before the turns whose entropy rose most (``entropy_branch_scores``:
    ARPO, AEPO). Round 0 spends ``fresh_fraction`` of the budget on fresh
    episodes; round 1 branches ``k`` ways from the state before each chosen
    turn, highest score first, until the budget is spent; what no turn earns
    goes to fresh episodes (``_OpenThenBranch``). The split between rounds is
    fixed, where AEPO sets it from an entropy pre-monitoring pass.
    ``in_turn``: fork inside the chosen turn instead, before its highest-entropy
    token among the first ``first_tokens`` (ARPO branches at the token level too)."""

    fresh_fraction: float = 0.5
    threshold: float = 0.5
    first_tokens: int = 8
    penalty: float = 0.5
    k: int = 2
    est_leaf_cost: float | None = None
    in_turn: bool = False

    name: ClassVar[str] = "entropy_branch"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 0
    branch_reason: ClassVar[str] = "entropy rise"
    leftover_reason: ClassVar[str] = "no high-entropy turn left"

    def __post_init__(self) -> None:
        _check(self, fresh_fraction="in (0, 1]", first_tokens=">= 1", penalty="in [0, 1]",
               k=">= 1", est_leaf_cost="None or > 0", in_turn="true or false")

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> list[tuple[int, int | None]]:
        ranked = []
        for task, tree in enumerate(state.trees):
            scores = entropy_branch_scores(tree, self.first_tokens, self.threshold, self.penalty)
            ranked += [(-score, task, node_id) for node_id, score in scores.items()]
        report["candidates"] = len(ranked)
        return [self._fork(state.trees[task], task, node_id, _entropies, max) for _, task, node_id in sorted(ranked)]


@dataclass
class SegmentTree:
    """TreePO-style segment trees (Li et al. 2025, "TreePO: Bridging the Gap of
    Policy Optimization and Efficacy and Inference Efficiency with Heuristic
    Tree-based Modeling"): every task grows a tree of ``segment_turns``-turn
    segments, ``depth`` levels deep, each open leaf splitting ``width`` ways; a
    full tree has ``width ** depth`` leaves (the first level is ``width`` fresh
    episodes: the prompt is the first branch point).

    The budget gives each task a target number of leaves (even split). Round 0
    starts ``ceil(target / width ** (depth - 1))`` episodes per task; round r
    (< depth) continues every open leaf, splitting as late as the width allows
    (``segment_children``). The last level, or a subtree that needs no more
    splits, runs to the end. A branch that finishes before the last level
    leaves part of its target unspent: each round that budget goes back, first
    to other tasks' open leaves (as far as their trees can still grow), the
    rest to fresh episodes, so a leaves budget is met exactly.
    Simplified: segments end at turn boundaries, not after a fixed number of
    tokens; no early stop of segments by heuristic scores; no reuse of
    fallback paths across batches.
    """

    depth: int = 4
    width: int = 2
    segment_turns: int = 1
    est_leaf_cost: float | None = None

    name: ClassVar[str] = "segment_tree"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 0

    def __post_init__(self) -> None:
        _check(self, depth=">= 1", width=">= 1", segment_turns=">= 1",
               est_leaf_cost="None or > 0")

    def plan(self, state: AllocState) -> list[Request]:
        leaves = affordable_leaves(state, self.est_leaf_cost)
        report = state.report.setdefault(self.name, {"targets": [], "given_back": 0})
        if state.round == 0:
            targets = fill_evenly([0] * len(state.trees), leaves)
            report["targets"] = targets
            out: list[Request] = []
            for task, target in enumerate(targets):
                roots = math.ceil(target / self.width ** (self.depth - 1))
                if roots:
                    paused = self.segment_turns if roots < target else None
                    out.append(Fresh(task, roots, max_turns=paused, reason="segment"))
            return out
        return self._grow(state, leaves, report)

    def _grow(self, state: AllocState, leaves: int, report: dict[str, Any]) -> list[Request]:
        level = state.round  # the level the children of this round's branches form
        rest = max(self.depth - 1 - level, 0)  # levels still to split after this one
        open_leaves = [[n for n in t.leaves() if is_open(n)] for t in state.trees]
        # Most leaves each task's tree can still add: every open leaf fully split.
        growth = self.width ** (self.depth - level) - 1 if level < self.depth else 0
        counts = _leaf_counts(state)
        extra = fill_evenly(counts, leaves, [len(o) * growth for o in open_leaves])
        out: list[Request] = []
        for task, (opened, e) in enumerate(zip(open_leaves, extra, strict=True)):
            if not opened:
                continue
            m = segment_children(len(opened), e, rest, self.width)
            paused = self.segment_turns if rest > 0 and m < len(opened) + e else None
            for j, leaf in enumerate(opened):
                k = m // len(opened) + (j < m % len(opened))
                out.append(Branch(task, leaf.id, k, max_turns=paused, reason="segment"))
        if level >= self.depth and not out:
            return _top_up(state, leaves, self.depth)
        # Past every open leaf's growth: budget of finished branches (and, in
        # turns or tokens, what the estimate left) goes to fresh episodes.
        given_back = leaves - sum(extra) if level < self.depth else 0
        report["given_back"] += given_back
        totals = [c + e for c, e in zip(counts, extra, strict=True)]
        return out + _fresh_spread(state, given_back, "given back by early finish", totals)


@dataclass
class KeyState(_OpenThenBranch):
    """Branch at decision states, after Spark (Wu et al. 2026, arXiv:2601.20209:
    branch only at critical states, within a fixed budget). Round 0 spends
    ``fresh_fraction`` of the budget on fresh episodes; round 1 branches ``k``
    ways from the state before each key state (``key_states``), lowest top-1
    probability first, until the budget is spent; the rest goes to fresh
    episodes (``_OpenThenBranch``). Simplified: Spark finds critical states
    from an explore signal the agent writes in its reasoning; we use the
    policy's own low top-1 probability instead, which needs ``top_logprobs = 1``
    from the backend. ``in_turn``: fork inside the key turn instead, before its
    lowest top-1 token among the first ``first_tokens``; this is what branches a
    single-turn task, whose only state before a turn is the prompt."""

    k: int = 2
    top1_threshold: float = 0.5
    first_tokens: int = 4
    fresh_fraction: float = 0.5
    est_leaf_cost: float | None = None
    in_turn: bool = False

    name: ClassVar[str] = "key_state"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 1
    branch_reason: ClassVar[str] = "key state"
    leftover_reason: ClassVar[str] = "no key state left"

    def __post_init__(self) -> None:
        _check(self, k=">= 1", top1_threshold="in (0, 1]", first_tokens=">= 1",
               fresh_fraction="in (0, 1]", est_leaf_cost="None or > 0", in_turn="true or false")

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> list[tuple[int, int | None]]:
        ranked = []
        for task, tree in enumerate(state.trees):
            ranked += [(p, task, node_id) for p, node_id in
                       key_states(tree, self.first_tokens, self.top1_threshold)]
        report["candidates"] = len(ranked)
        # without top-1 probabilities (a backend that ignored top_logprobs) nothing is a key state
        report["top1_seen"] = any(n.top1 for t in state.trees for n in t.nodes.values())
        return [self._fork(state.trees[task], task, node_id, _top1, min) for _, task, node_id in sorted(ranked)]


@dataclass
class Contrastive(_OpenThenBranch):
    """Contrastive branching (CBPO): round 0 spends ``fresh_fraction`` of the
    budget on fresh episodes; round 1 branches ``k`` ways from the points that
    ``contrastive_branch_points`` ranks first, until the budget is spent (the
    rest to fresh episodes; ``_OpenThenBranch``). The last call writes
    ``prefix_groups`` into every tree's ``meta["prefix_groups"]`` for credit
    assignment. Deterministic: no sampling, so no seed."""

    k: int = 2
    path_decay: float = 0.5
    node_decay: float = 0.5
    fresh_fraction: float = 0.5
    est_leaf_cost: float | None = None

    name: ClassVar[str] = "contrastive"
    needs_snapshots: ClassVar[bool] = True
    top_logprobs: ClassVar[int] = 0
    branch_reason: ClassVar[str] = "contrastive"
    leftover_reason: ClassVar[str] = "no branch point left"

    def __post_init__(self) -> None:
        _check(self, k=">= 1", path_decay="in (0, 1]", node_decay="in (0, 1]",
               fresh_fraction="in (0, 1]", est_leaf_cost="None or > 0")

    def plan(self, state: AllocState) -> list[Request]:
        out = super().plan(state)
        if not out:
            for tree in state.trees:
                tree.meta["prefix_groups"] = prefix_groups(tree)
        return out

    def _branch_points(self, state: AllocState,
                       report: dict[str, Any]) -> Iterator[tuple[int, int]]:
        # lazy: each point is ranked after the picks before it, and few are taken
        return contrastive_branch_points(state.trees, self.path_decay, self.node_decay)


# --------------------------------------------------------------------------- registry

ALLOCATORS: dict[str, type[Allocator]] = {
    "independent": Independent,
    "pilot_commit": PilotCommit,
    "entropy_branch": EntropyBranch,
    "segment_tree": SegmentTree,
    "key_state": KeyState,
    "contrastive": Contrastive,
}


def make_allocator(name: str, **options: Any) -> Allocator:
    """Build the allocator registered as ``name`` with ``options`` (its fields).

    Raises ``ConfigError`` (a ``ValueError``) naming an unknown allocator or
    option, with the valid ones.
    """
    cls = ALLOCATORS.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, ALLOCATORS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown allocator {name!r}{hint}; valid: {', '.join(ALLOCATORS)}")
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"allocator {name}: unknown option {unknown[0]!r}; valid options: {', '.join(valid)}"
        )
    return cls(**options)
