"""The credit registry: every credit method by name, one ``Estimator`` each.

An ``Estimator`` turns the kept episodes of a batch (those that did not fail),
grouped by tree, into per-turn advantages through one call,
``turns(batch, options)``. Its ``options`` model (``agentrl.credit_options``)
is what ``train.credit`` validates to. The equations stay in the family
files (``group``, ``gigpo``, ``tree``, ``returns``, ``gdpo``); an adapter
here only feeds a family function the episodes, and says whether its
statistics span one tree (``scope="group"``) or the whole batch (``"batch"``).
``assign`` calls ``ESTIMATORS[method]`` and never branches on the name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from agentrl.credit_options import (
    CreditMethodOptions,
    DrGRPOOptions,
    GAEOptions,
    GDPOOptions,
    GiGPOOptions,
    GRPOOptions,
    MCGRPOOptions,
    ReturnsOptions,
    RLOOOptions,
    TreeOptions,
)
from agentrl.types import Episode, EpisodeGroup

from .gdpo import gdpo
from .gigpo import gigpo_advantages, gigpo_episode_advantages
from .group import dr_grpo, grpo, mc_grpo, rloo
from .outcome import Outcome, episode_outcome
from .returns import discounted_returns, episode_gae, gae, normalize
from .tree import tree_advantages, turn_advantages

__all__ = ["ESTIMATORS", "CreditBatch", "Estimator", "credit_options"]

PerTurn = list[list[list[float]]]
"""Advantages ``[tree][kept episode][turn]``."""


@dataclass(frozen=True, slots=True)
class CreditBatch:
    """What an estimator reads: each tree's kept episodes, and the inputs only code can give.

    ``kept[t]`` are the episodes of tree ``groups[t]`` that did not fail, in leaf order;
    ``failed_leaves[t]`` the leaf ids of those that did (left out of every statistic).
    """

    groups: list[EpisodeGroup]
    kept: list[list[Episode]]
    failed_leaves: list[set[int]]
    outcome: Outcome = "return"
    reward_fn: Callable[[Episode], Any] | None = None
    value_fn: Callable[[Episode], Sequence[float]] | None = None

    def flat(self) -> tuple[list[Episode], list[int]]:
        """Every kept episode of the batch, and the index of the tree (group) of each."""
        return ([e for eps in self.kept for e in eps],
                [t for t, eps in enumerate(self.kept) for _ in eps])

    def split(self, per_episode: list[Any]) -> PerTurn:
        """Values of ``flat()``'s episodes cut back into one list per tree."""
        out, i = [], 0
        for eps in self.kept:
            out.append(per_episode[i : i + len(eps)])
            i += len(eps)
        return out


@dataclass(frozen=True, slots=True)
class Estimator:
    """One credit method.

    ``fn`` is the pure function with the paper's equation; ``turns(batch, options)`` gives
    the per-turn advantages of every kept episode; ``options`` is the method's options
    model; ``scope`` says whose statistics it uses (one tree's, or the whole batch's);
    ``reads`` names the code-only inputs of ``CreditBatch`` it uses; ``pivot`` is MC-GRPO's:
    the median episode of an odd group is left out of the loss.
    """

    fn: Callable[..., Any]
    turns: Callable[[CreditBatch, Any], PerTurn]
    options: type[CreditMethodOptions]
    scope: Literal["group", "batch"]
    reads: frozenset[str] = frozenset()
    pivot: bool = False


def _scalar(fn: Callable[..., Any]) -> Callable[[CreditBatch, Any], PerTurn]:
    """One advantage per episode from its group's outcomes (GRPO family), on every turn."""

    def turns(batch: CreditBatch, options: Any) -> PerTurn:
        out: PerTurn = []
        for eps in batch.kept:
            scores = fn([episode_outcome(e, batch.outcome) for e in eps], **options.arguments()) if eps else []
            out.append([[a] * e.num_turns for e, a in zip(eps, scores, strict=True)])
        return out

    return turns


def _gigpo_turns(batch: CreditBatch, options: GiGPOOptions) -> PerTurn:
    """GiGPO per tree: its episodes' rewards and the anchor states of its turns."""
    return [gigpo_episode_advantages(eps, g.tree, **options.arguments()) if eps else []
            for g, eps in zip(batch.groups, batch.kept, strict=True)]


def _tree_turns(batch: CreditBatch, options: TreeOptions) -> PerTurn:
    """TreeRL per tree: node advantages over the kept leaves, read at each turn's node."""
    out: PerTurn = []
    for g, eps, failed in zip(batch.groups, batch.kept, batch.failed_leaves, strict=True):
        advs = tree_advantages(g.tree, batch.outcome, exclude=failed, episodes=g.by_leaf(),
                               **options.arguments()) if eps else {}
        out.append([turn_advantages(e, advs) for e in eps])
    return out


def _gdpo_turns(batch: CreditBatch, options: GDPOOptions) -> PerTurn:
    """GDPO over the batch: each reward of ``reward_fn`` normalised within its tree."""
    if batch.reward_fn is None:
        raise ValueError("method='gdpo' needs reward_fn: Episode -> {reward name: value}")
    flat, group_of = batch.flat()
    scores = gdpo([dict(batch.reward_fn(e)) for e in flat], groups=group_of, **options.arguments()) if flat else []
    return batch.split([[a] * e.num_turns for e, a in zip(flat, scores, strict=True)])


def _normalized(batch: CreditBatch, per_turn: list[Any], level: str | None) -> PerTurn:
    _, group_of = batch.flat()
    return batch.split(per_turn if level is None else normalize(per_turn, level, group_of))


def _returns_turns(batch: CreditBatch, options: ReturnsOptions) -> PerTurn:
    """Discounted returns of every turn, whitened at ``options.level`` over the batch."""
    flat, _ = batch.flat()
    return _normalized(batch, [discounted_returns(e.rewards, options.gamma) for e in flat], options.level)


def _gae_turns(batch: CreditBatch, options: GAEOptions) -> PerTurn:
    """GAE of every turn with ``value_fn`` (without one, the discounted returns), whitened at ``options.level``."""
    flat, _ = batch.flat()
    per_turn = [episode_gae(e, batch.value_fn, options.gamma, options.lam) for e in flat]
    return _normalized(batch, per_turn, options.level)


_OUTCOME = frozenset({"outcome"})

ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, _scalar(grpo), GRPOOptions, "group", _OUTCOME),
    "dr_grpo": Estimator(dr_grpo, _scalar(dr_grpo), DrGRPOOptions, "group", _OUTCOME),
    "rloo": Estimator(rloo, _scalar(rloo), RLOOOptions, "group", _OUTCOME),
    "mc_grpo": Estimator(mc_grpo, _scalar(mc_grpo), MCGRPOOptions, "group", _OUTCOME, pivot=True),
    "gigpo": Estimator(gigpo_advantages, _gigpo_turns, GiGPOOptions, "group"),
    "tree": Estimator(tree_advantages, _tree_turns, TreeOptions, "group", _OUTCOME),
    "gdpo": Estimator(gdpo, _gdpo_turns, GDPOOptions, "batch", frozenset({"reward_fn"})),
    "returns": Estimator(discounted_returns, _returns_turns, ReturnsOptions, "batch"),
    "gae": Estimator(gae, _gae_turns, GAEOptions, "batch", frozenset({"value_fn"})),
}
"""Every credit method, by the name ``train.credit`` and ``assign`` use."""


def credit_options(method: str | CreditMethodOptions, **options: Any) -> CreditMethodOptions:
    """The validated options model of ``method`` (a name, or a model that ``options`` update).

    Raises ``ValueError`` on an unknown method (listing the valid ones) or a bad value,
    naming the option, and ``TypeError`` on an unknown option (as for a keyword argument).
    """
    if isinstance(method, CreditMethodOptions) and not options:
        return method
    if isinstance(method, CreditMethodOptions):
        options, method = {**method.model_dump(exclude_unset=True), **options}, method.name
    if method not in ESTIMATORS:
        close = difflib.get_close_matches(str(method), ESTIMATORS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown credit method {method!r}{hint}; choose one of {sorted(ESTIMATORS)}")
    model = ESTIMATORS[method].options
    valid = [k for k in model.model_fields if k != "name"]
    unknown = sorted(k for k in options if k not in model.model_fields)
    if unknown:
        raise TypeError(f"unknown options for method={method!r}: {unknown}; valid: {', '.join(valid) or 'none'}")
    try:
        return model.model_validate(options)
    except ValidationError as e:
        reasons = "; ".join(f"option {'.'.join(map(str, err['loc']))!r}: {err['msg']}" for err in e.errors())
        raise ValueError(f"credit method {method}: {reasons}") from None
