"""Credit assignment: from rollout trees to per-token advantages.

One file per family, each a set of small pure functions:

- ``group``: one advantage per episode from the group's outcomes (GRPO,
  Dr. GRPO, RLOO, MC-GRPO);
- ``gigpo``: episode plus anchor-state step advantages (GiGPO);
- ``tree``: node values from the leaves below (TreeRL, contrastive siblings);
- ``returns``: discounted returns, GAE over turns, normalisation levels;
- ``gdpo``: several rewards, normalised apart, then combined (GDPO);
- ``outcome``: the one number per episode the group and tree methods compare
  (``"return"``, ``"success"`` or a callable), named ``outcome`` everywhere;
- ``registry``: ``ESTIMATORS``, every method by name, each an ``Estimator``
  that feeds its family function the kept episodes of the batch.

A *group* is the episodes (root-to-leaf paths) of one ``RolloutTree``, i.e. of
one task. ``assign`` is the trainer's single entry point: it validates the
method's options (``agentrl.credit_options``, what ``train.credit`` holds),
calls ``ESTIMATORS[method]`` on the batch and spreads each turn's advantage
over that turn's action tokens with ``to_token_advantages``.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.credit_options import CreditMethodOptions
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
from .registry import ESTIMATORS, CreditBatch, Estimator, credit_options
from .returns import discounted_returns, episode_gae, gae, normalize
from .tree import leaf_outcome, node_values, tree_advantages

__all__ = [
    "ESTIMATORS",
    "FAILED_EPISODES",
    "CreditBatch",
    "CreditReport",
    "Estimator",
    "anchor_group_stats",
    "anchor_groups",
    "assign",
    "assign_report",
    "credit_options",
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

# What credit does with a failed episode (``Node.error`` set): leave it out, keep it with zero
# advantage (neither enters a baseline), or credit it as an ordinary episode with the rewards
# it earned before failing (it enters the baselines: a policy whose output makes episodes fail,
# a harness exiting non-zero say, is pushed away from it, and so are failures it did not cause).
FAILED_EPISODES: tuple[str, ...] = ("exclude", "zero", "credit")


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


def _credit_batch(groups: list[EpisodeGroup], report: CreditReport, outcome: Outcome,
                  reward_fn: Any, value_fn: Any, failed: str = "exclude") -> tuple[CreditBatch, list[list[Episode]]]:
    """The batch an estimator reads (failed episodes listed in ``report``, and set aside
    unless ``failed`` is ``credit``), and the failed episodes set aside from each tree."""
    kept: list[list[Episode]] = []
    bad: list[list[Episode]] = []
    bad_leaves: list[set[int]] = []
    for t, group in enumerate(groups):
        good, fails, leaves = [], [], set()
        for leaf_id, episode in zip(group.leaf_ids, group.episodes, strict=True):
            if episode.error:
                report.failed.append((t, leaf_id, episode.error))
            if episode.error and failed != "credit":
                fails.append(episode)
                leaves.add(leaf_id)
            else:
                good.append(episode)
        kept.append(good)
        bad.append(fails)
        bad_leaves.append(leaves)
    return CreditBatch(groups, kept, bad_leaves, outcome, reward_fn, value_fn), bad


def assign_report(
    trees: Sequence[RolloutTree | EpisodeGroup],
    method: str | CreditMethodOptions,
    failed: str = "exclude",
    outcome: Outcome | None = None,
    *,
    reward_fn: Callable[[Episode], Mapping[str, float]] | None = None,
    value_fn: Callable[[Episode], Sequence[float]] | None = None,
    **options: Any,
) -> CreditReport:
    """Per-token advantages for every root-to-leaf episode of every tree.

    ``method`` is a key of ``ESTIMATORS`` (``options`` are its options, validated by its
    model in ``agentrl.credit_options``), or such a model (``train.credit``), which
    ``options`` update. The group of an episode is its tree; ``trees`` may be
    ``EpisodeGroup``s whose episodes are built already. ``failed`` is one of
    ``FAILED_EPISODES`` (``rollout.failed_episodes``). Inputs no config can hold:

    - ``outcome``: an episode's scalar result for the group methods and ``tree``:
      ``"return"`` (sum of rewards, the default), ``"success"`` (both also an option of
      those methods) or a callable on the ``Episode``;
    - ``reward_fn`` (``gdpo``, required): Episode -> {reward name: value};
    - ``value_fn`` (``gae``): Episode -> per-turn values, plus optionally ``V`` of the
      state after the last turn for an episode cut short; without it V = 0.

    Raises ``ValueError`` on an unknown method or a bad option value, ``TypeError`` on an
    option or input the method does not read.
    """
    if isinstance(outcome, str):
        options["outcome"] = outcome  # the option of that name, validated with the others
    opts = credit_options(method, **options)
    estimator = ESTIMATORS[opts.name]
    given = {"outcome": callable(outcome), "reward_fn": reward_fn is not None, "value_fn": value_fn is not None}
    unread = sorted(k for k, v in given.items() if v and k not in estimator.reads)
    if unread:
        raise TypeError(f"credit method {opts.name!r} does not read {', '.join(unread)}")
    if failed not in FAILED_EPISODES:
        raise ValueError(f"failed must be one of {', '.join(map(repr, FAILED_EPISODES))}, not {failed!r}")
    report = CreditReport()
    resolved = outcome if callable(outcome) else getattr(opts, "outcome", "return")
    batch, bad = _credit_batch([EpisodeGroup.of(t) for t in trees], report, resolved, reward_fn, value_fn, failed)
    turns = estimator.turns(batch, opts)
    for tree_idx, (eps, per_turn) in enumerate(zip(batch.kept, turns, strict=True)):
        drop = None  # MC-GRPO: the pivot carries no gradient
        if estimator.pivot and len(eps) > 1:
            drop = mc_grpo_pivot([episode_outcome(e, resolved) for e in eps])
        for j, (episode, adv) in enumerate(zip(eps, per_turn, strict=True)):
            if j == drop:
                report.pivots += 1
                continue
            report.items.append((episode, to_token_advantages(episode, adv)))
        if failed == "zero":
            for episode in bad[tree_idx]:
                report.items.append((episode, [0.0] * len(episode.input_ids)))
    return report


def assign(
    trees: Sequence[RolloutTree | EpisodeGroup],
    method: str | CreditMethodOptions,
    failed: str = "exclude",
    outcome: Outcome | None = None,
    **options: Any,
) -> list[tuple[Episode, list[float]]]:
    """``assign_report(...).items``, logging how many failed episodes were left out or zeroed."""
    report = assign_report(trees, method, failed, outcome, **options)
    if report.failed:
        reasons = Counter(err for _, _, err in report.failed)
        log.warning(
            "credit: %d failed episode(s) %s (%s)",
            len(report.failed),
            {"exclude": "left out", "zero": "given 0 advantage", "credit": "credited as ordinary episodes"}[failed],
            "; ".join(f"{n}x {r}" for r, n in reasons.items()),
        )
    return report.items

