"""Credit assignment: from rollout trees to per-token advantages.

One file per family, each a set of small pure functions:

- ``group``: one advantage per episode from the group's outcomes (GRPO,
  Dr. GRPO, RLOO, MC-GRPO);
- ``gigpo``: episode plus anchor-state step advantages (GiGPO);
- ``tree``: node values from the leaves below (TreeRL, contrastive siblings);
- ``returns``: discounted returns, GAE over turns, normalisation levels;
- ``gdpo``: several rewards, normalised apart, then combined (GDPO);
- ``outcome``: the one number per episode the group and tree methods compare
  (``"return"``, ``"success"`` or a callable), named ``outcome`` everywhere.

A *group* is the episodes (root-to-leaf paths) of one ``RolloutTree``, i.e. of
one task. ``assign`` is the trainer's single entry point: it runs one
``ESTIMATORS`` method on every tree and spreads each turn's advantage over
that turn's action tokens with ``to_token_advantages``.

Failed episodes (``episode.error`` set: the env, sandbox or context budget
ended them, not the model) never enter any baseline or statistic. With
``failed="exclude"`` they are left out of the result; with ``"zero"`` they
are returned with all-zero advantages (their tokens still count in a
token-mean loss). Either way ``assign_report`` lists them, and ``assign``
logs how many there were.
"""

from __future__ import annotations

import logging
import numbers
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Episode, EpisodeGroup, RolloutTree

from .gdpo import gdpo
from .gigpo import (
    anchor_group_stats,
    anchor_groups,
    episode_state_keys,
    gigpo_advantages,
    gigpo_episode_advantages,
)
from .group import dr_grpo, grpo, mc_grpo, mc_grpo_pivot, rloo
from .outcome import Outcome, episode_outcome
from .returns import discounted_returns, gae, normalize
from .tree import leaf_outcome, node_values, tree_advantages, turn_advantages

__all__ = [
    "ESTIMATORS",
    "CreditReport",
    "anchor_group_stats",
    "anchor_groups",
    "assign",
    "assign_report",
    "discounted_returns",
    "dr_grpo",
    "episode_gae",
    "episode_outcome",
    "episode_state_keys",
    "gae",
    "gdpo",
    "gigpo_advantages",
    "gigpo_episode_advantages",
    "grpo",
    "leaf_outcome",
    "mc_grpo",
    "mc_grpo_pivot",
    "node_values",
    "normalize",
    "rloo",
    "to_token_advantages",
    "tree_advantages",
]

log = logging.getLogger(__name__)

# Every advantage estimator, by the name a config uses. ``assign`` accepts these names.
ESTIMATORS: dict[str, Callable[..., Any]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "mc_grpo": mc_grpo,
    "gigpo": gigpo_advantages,
    "tree": tree_advantages,
    "gdpo": gdpo,
    "returns": discounted_returns,
    "gae": gae,
}
_SCALAR = ("grpo", "dr_grpo", "rloo", "mc_grpo")  # one advantage per episode


def to_token_advantages(episode: Episode, turn_advantages: float | Sequence[float]) -> list[float]:
    """Per-token advantages aligned with ``episode.input_ids``.

    Context tokens get 0; turn ``k``'s action tokens (``episode.turn_spans[k]``,
    including the tokens of a segment fork's partial node) get
    ``turn_advantages[k]``. A single number is the advantage of every turn.
    """
    spans = episode.turn_spans
    if isinstance(turn_advantages, numbers.Real):  # numpy scalars too
        per_turn = [float(turn_advantages)] * len(spans)
    else:
        per_turn = [float(a) for a in turn_advantages]
        if len(per_turn) != len(spans):
            raise ValueError(
                f"turn_advantages has {len(per_turn)} entries but the episode has {len(spans)} turns"
            )
    out = [0.0] * len(episode.input_ids)
    for (start, end), a in zip(spans, per_turn, strict=True):
        out[start:end] = [a] * (end - start)
    return out


@dataclass(slots=True)
class CreditReport:
    """What ``assign`` computed and what it left out.

    ``items`` pairs each episode with its per-token advantages. ``failed``
    names each failed episode as ``(tree index, leaf node id, error)``.
    ``pivots`` counts MC-GRPO pivot episodes left out of the loss.
    """

    items: list[tuple[Episode, list[float]]] = field(default_factory=list)
    failed: list[tuple[int, int, str]] = field(default_factory=list)
    pivots: int = 0


def _tree_turns(
    method: str,
    group: EpisodeGroup,
    episodes: list[Episode],
    failed_leaves: set[int],
    outcome: Outcome,
    options: dict[str, Any],
) -> list[list[float]]:
    """Per-turn advantages of the kept ``episodes`` of one tree (one group)."""
    if method in _SCALAR:
        scores = ESTIMATORS[method]([episode_outcome(e, outcome) for e in episodes], **options)
        return [[a] * e.num_turns for e, a in zip(episodes, scores, strict=True)]
    if method == "gigpo":
        return gigpo_episode_advantages(episodes, group.tree, **options)
    if method == "tree":
        advs = tree_advantages(group.tree, outcome, exclude=failed_leaves, episodes=group.by_leaf(), **options)
        return [turn_advantages(e, advs) for e in episodes]
    raise AssertionError(method)  # batch-level methods are handled by assign_report


def episode_gae(e: Episode, value_fn: Callable[[Episode], Sequence[float]] | None, gamma: float,
                lam: float) -> Any:
    """GAE for one episode; ``value_fn`` may give one value more than turns: the bootstrap
    ``V`` of the state after the last turn, for an episode cut short. An episode the env
    terminated bootstraps with 0 whatever ``value_fn`` says."""
    if value_fn is None:
        return gae(e.rewards, None, gamma, lam)
    v = list(value_fn(e))
    if len(v) not in (e.num_turns, e.num_turns + 1):
        raise ValueError(f"value_fn gave {len(v)} values for an episode of {e.num_turns} turns "
                         "(one a turn, plus an optional bootstrap)")
    cut = len(v) > e.num_turns and not (e.nodes and e.nodes[-1].terminated)
    return gae(e.rewards, v[:e.num_turns], gamma, lam, v[e.num_turns] if cut else 0.0)


def _batch_turns(
    method: str, kept: list[list[Episode]], options: dict[str, Any]
) -> list[list[list[float]]]:
    """Per-turn advantages for methods whose statistics span the whole batch."""
    flat = [e for eps in kept for e in eps]
    group_of = [g for g, eps in enumerate(kept) for _ in eps]
    if method == "gdpo":
        reward_fn = options.pop("reward_fn", None)
        if reward_fn is None:
            raise ValueError("method='gdpo' needs reward_fn: Episode -> {reward name: value}")
        scores = gdpo([dict(reward_fn(e)) for e in flat], groups=group_of, **options) if flat else []
        per_turn = [[a] * e.num_turns for e, a in zip(flat, scores, strict=True)]
    else:  # "returns" or "gae"
        gamma = options.pop("gamma", 1.0)
        level = options.pop("level", "group")
        value_fn = options.pop("value_fn", None)
        lam = options.pop("lam", 1.0)
        if options:
            raise TypeError(f"unknown options for method={method!r}: {sorted(options)}")
        if method == "gae":
            per_turn = [episode_gae(e, value_fn, gamma, lam) for e in flat]
        else:
            per_turn = [discounted_returns(e.rewards, gamma) for e in flat]
        if level is not None:
            per_turn = normalize(per_turn, level, group_of)
    out, i = [], 0
    for eps in kept:
        out.append(per_turn[i : i + len(eps)])
        i += len(eps)
    return out


def assign_report(
    trees: Sequence[RolloutTree | EpisodeGroup],
    method: str,
    failed: str = "exclude",
    outcome: Outcome = "return",
    **options: Any,
) -> CreditReport:
    """Per-token advantages for every root-to-leaf episode of every tree.

    ``method`` is a key of ``ESTIMATORS``; ``options`` go to it. ``outcome``
    is an episode's scalar result for the group methods and the tree method:
    ``"return"`` (sum of rewards), ``"success"`` or a callable. The group of
    an episode is its tree; ``trees`` may be ``EpisodeGroup``s whose episodes are
    built already. Extra per-method options:
    ``gdpo`` needs ``reward_fn`` (Episode -> {name: value}) and takes
    ``weights``, ``batch_norm``, ``eps``; ``returns`` and ``gae`` take
    ``gamma``, ``lam``, ``value_fn`` (Episode -> per-turn values, plus optionally
    ``V`` of the state after the last turn for an episode cut short) and
    ``level`` (a ``normalize`` level, default ``"group"``, or None).
    """
    if method not in ESTIMATORS:
        raise ValueError(f"unknown credit method {method!r}; choose one of {sorted(ESTIMATORS)}")
    if failed not in ("exclude", "zero"):
        raise ValueError(f"failed must be 'exclude' or 'zero', not {failed!r}")
    report = CreditReport()
    kept: list[list[Episode]] = []
    bad: list[list[Episode]] = []
    bad_leaves: list[set[int]] = []
    groups = [EpisodeGroup.of(t) for t in trees]  # each tree's episodes, built once
    for t, group in enumerate(groups):
        good, fails, leaves = [], [], set()
        for leaf_id, episode in zip(group.leaf_ids, group.episodes, strict=True):
            if episode.error:
                fails.append(episode)
                leaves.add(leaf_id)
                report.failed.append((t, leaf_id, episode.error))
            else:
                good.append(episode)
        kept.append(good)
        bad.append(fails)
        bad_leaves.append(leaves)

    if method in ("gdpo", "returns", "gae"):
        turns = _batch_turns(method, kept, dict(options))
    else:
        turns = [
            _tree_turns(method, group, eps, leaves, outcome, dict(options)) if eps else []
            for group, eps, leaves in zip(groups, kept, bad_leaves, strict=True)
        ]

    for tree_idx, (eps, per_turn) in enumerate(zip(kept, turns, strict=True)):
        drop = None
        if method == "mc_grpo":
            drop = mc_grpo_pivot([episode_outcome(e, outcome) for e in eps]) if len(eps) > 1 else None
        for j, (episode, adv) in enumerate(zip(eps, per_turn, strict=True)):
            if j == drop:
                report.pivots += 1  # MC-GRPO: the pivot carries no gradient
                continue
            report.items.append((episode, to_token_advantages(episode, adv)))
        if failed == "zero":
            for episode in bad[tree_idx]:
                report.items.append((episode, [0.0] * len(episode.input_ids)))
    return report


def assign(
    trees: Sequence[RolloutTree | EpisodeGroup],
    method: str,
    failed: str = "exclude",
    outcome: Outcome = "return",
    **options: Any,
) -> list[tuple[Episode, list[float]]]:
    """``assign_report(...).items``, logging how many failed episodes were left out or zeroed."""
    report = assign_report(trees, method, failed, outcome, **options)
    if report.failed:
        reasons = Counter(err for _, _, err in report.failed)
        log.warning(
            "credit: %d failed episode(s) %s (%s)",
            len(report.failed),
            "left out" if failed == "exclude" else "given 0 advantage",
            "; ".join(f"{n}x {r}" for r, n in reasons.items()),
        )
    return report.items

