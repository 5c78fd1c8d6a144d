"""Tree advantages: a node's value is the mean outcome of the leaves below it.

TreeRL (Hou, Hu, Li, Lu, Tang & Dong 2025, "TreeRL: LLM Reinforcement
Learning with On-Policy Tree Search", arXiv 2506.11902, process supervision
from the tree):

- ``V(n) = mean of outcome(l) over the leaves l under n``;
- global advantage ``G(n) = V(n) - V(root)``: how much better than the task's
  average this prefix is;
- local advantage ``L(n) = V(n) - V(parent(n))``: how much this step improved
  on the state it was taken in;
- ``R(n) = (G(n) + L(n)) / sqrt(|leaves(n)|)``, the square root damping
  nodes shared by many leaves, since their tokens recur in every episode
  through them.

We expose the weights: ``A(n) = (w_g * G(n) + w_l * L(n)) / norm(n)`` with
``global_weight=w_g=1``, ``local_weight=w_l=1`` and ``leaf_norm="sqrt"`` (the
TreeRL values) or ``"none"``. TreePO (Li et al. 2025, arXiv 2508.17445)
also mixes a global and a subtree-local baseline; setting the
weights covers its unnormalised form.

Contrastive branch scaling (``contrastive=True``). Our reading of the "CBPO"
idea (we could not check it against a paper): siblings share an
exact prefix, so their value differences isolate the one decision that
separates them. In each sibling set with at least two distinct values, every
sibling's advantage is divided by the population std of the siblings'
values (plus ``eps``), with the factor clamped to ``[1, max_scale]``. A
positive factor never flips a sign; the clamp keeps a set of near-equal
values from exploding and never shrinks a set's signal.

Trees. A leaf's outcome is that of the episode ending there
(``agentrl.credit.outcome``: ``"return"``, the sum of rewards along the
root-to-leaf path; ``"success"``; or any callable on the ``Episode``).
Several roots hang under a virtual super-root whose value is the mean over
all leaves; it is ``V(root)`` in ``G`` and the parent of each root in ``L``. A partial node (a segment fork
inside a turn) has a value and an advantage like any node, and is the parent
of its continuations; in an ``Episode`` its tokens belong to the child's
turn, so the turn's advantage is the turn-ending node's.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from typing import Any

import numpy as np

from agentrl.types import Episode, Node, RolloutTree

from .outcome import Outcome, episode_outcome

__all__ = ["SUPER_ROOT", "leaf_outcome", "node_values", "tree_advantages", "turn_advantages"]

SUPER_ROOT = -1  # the key of the virtual super-root in ``node_values``' result


def leaf_outcome(tree: RolloutTree, leaf: Node, outcome: Outcome = "return") -> float:
    """The outcome of the episode that ends at ``leaf``."""
    return episode_outcome(Episode.from_path(tree.path(leaf.id)), outcome)


def _leaf_stats(
    tree: RolloutTree, outcome: Outcome, exclude: Container[int], episodes: Mapping[int, Episode] | None
) -> dict[int, tuple[float, int]]:
    """``{node_id: (sum of outcomes, number of leaves)}`` over the kept leaves below each node.

    ``episodes`` maps leaf ids to their episodes when the caller built them already.
    Raises ``ValueError`` on a non-finite outcome, which would make every value above
    its leaf NaN (the group methods refuse one too).
    """
    stats: dict[int, tuple[float, int]] = {}
    for leaf in tree.leaves():
        if leaf.id in exclude:
            continue
        path = tree.path(leaf.id)
        r = episode_outcome(episodes[leaf.id] if episodes is not None else Episode.from_path(path), outcome)
        if not math.isfinite(r):
            raise ValueError(f"the outcome of the episode ending at leaf {leaf.id} must be finite, got {r}")
        for node in path:
            s, k = stats.get(node.id, (0.0, 0))
            stats[node.id] = (s + r, k + 1)
    return stats


def _values(tree: RolloutTree, stats: dict[int, tuple[float, int]]) -> dict[int, float]:
    values = {i: s / k for i, (s, k) in stats.items()}
    kept = [stats[r] for r in tree.roots if r in stats]
    if kept:
        values[SUPER_ROOT] = sum(s for s, _ in kept) / sum(k for _, k in kept)
    return values


def node_values(
    tree: RolloutTree, outcome: Outcome = "return", exclude: Container[int] = (),
    episodes: Mapping[int, Episode] | None = None,
) -> dict[int, float]:
    """``V(n)`` for every node with at least one kept leaf below it, and ``V`` of
    the super-root under the key ``SUPER_ROOT``.

    ``exclude`` holds leaf ids left out of every mean (failed episodes, say);
    nodes with no kept leaf get no value. ``episodes``: leaf id -> its episode, if built.
    """
    return _values(tree, _leaf_stats(tree, outcome, exclude, episodes))


def tree_advantages(
    tree: RolloutTree,
    outcome: Outcome = "return",
    global_weight: float = 1.0,
    local_weight: float = 1.0,
    leaf_norm: str = "sqrt",
    contrastive: bool = False,
    max_scale: float = 10.0,
    eps: float = 1e-6,
    exclude: Container[int] = (),
    episodes: Mapping[int, Episode] | None = None,
) -> dict[int, float]:
    """TreeRL's per-node advantage (see the module docstring), for nodes with a value."""
    if leaf_norm not in ("sqrt", "none"):
        raise ValueError(f"leaf_norm must be 'sqrt' or 'none', not {leaf_norm!r}")
    if max_scale < 1.0:
        raise ValueError(f"max_scale must be >= 1, got {max_scale}")
    stats = _leaf_stats(tree, outcome, exclude, episodes)
    values = _values(tree, stats)
    if not stats:
        return {}
    v_root = values[SUPER_ROOT]
    out: dict[int, float] = {}
    for i, v in values.items():
        if i == SUPER_ROOT:
            continue
        parent = tree.nodes[i].parent
        v_parent = values[SUPER_ROOT if parent is None else parent]
        a = global_weight * (v - v_root) + local_weight * (v - v_parent)
        out[i] = a / math.sqrt(stats[i][1]) if leaf_norm == "sqrt" else a
    if contrastive:
        _scale_siblings(tree, values, out, max_scale, eps)
    if not all(map(math.isfinite, out.values())):  # outcomes near 1e308: sums and gains overflow
        raise ValueError(f"tree advantages overflow float64 at nodes {sorted(i for i, a in out.items() if not math.isfinite(a))}"
                         f" (outcomes near {np.finfo(np.float64).max:.3g}): scale the rewards down")
    return out


def _scale_siblings(
    tree: RolloutTree,
    values: dict[int, float],
    advs: dict[int, float],
    max_scale: float,
    eps: float,
) -> None:
    """Divide each sibling set's advantages by the std of its values, clamped to [1, max_scale]."""
    sets: list[list[int]] = [list(tree.roots)] + [n.children for n in tree.nodes.values()]
    for siblings in sets:
        ids = [i for i in siblings if i in advs]
        if len(ids) < 2:
            continue
        std = float(np.std([values[i] for i in ids]))
        if std == 0.0:
            continue  # no contrast to sharpen
        factor = min(max(1.0 / (std + eps), 1.0), max_scale)
        for i in ids:
            advs[i] *= factor


def turn_advantages(episode: Episode, advs: dict[int, Any]) -> list[float]:
    """Per-turn advantages of ``episode`` from per-node ones (0 for a node without one)."""
    return [float(advs.get(n.id, 0.0)) for n in episode.nodes]
