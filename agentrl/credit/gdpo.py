"""GDPO: normalise each reward within its group first, then combine.

Liu, Dong, Lu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
Optimization for Multi-reward RL Optimization" (arXiv 2601.05242).
With several rewards per episode, GRPO on their sum maps different reward
combinations onto the same advantage. GDPO instead:

1. normalises every reward ``k`` on its own within the group,
   ``A_k,i = (r_k,i - mean_group(r_k)) / (std_group(r_k) + eps)``;
2. sums them with weights, ``A_i = sum_k w_k * A_k,i``;
3. renormalises the sums over the whole batch,
   ``A_i <- (A_i - mean_batch(A)) / (std_batch(A) + eps)``, so the scale does
   not grow with the number of rewards.

Stds are sample stds, as in ``group.py``. A reward that is constant inside a
group contributes 0 there; a group of one contributes 0.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from .group import _center_scale, _like, _scaled, _unscaled

__all__ = ["gdpo"]


def _matrix(rewards: Any) -> tuple[np.ndarray, list[str] | None]:
    """Rewards as an ``[episodes, rewards]`` float array, and the reward names for dict rows."""
    if type(rewards).__module__.startswith("torch"):
        rewards = rewards.detach().cpu().double().numpy()
    if isinstance(rewards, Sequence) and rewards and isinstance(rewards[0], Mapping):
        names = list(rewards[0])
        for i, row in enumerate(rewards):
            if not isinstance(row, Mapping) or set(row) != set(names):
                raise ValueError(f"rewards[{i}] must have the keys {names}")
        return np.array([[float(row[k]) for k in names] for row in rewards]), names
    m = np.asarray(rewards, dtype=np.float64)
    if m.size == 0:
        return m.reshape(0, 0), None
    if m.ndim != 2:
        raise ValueError(f"rewards must be 2-D [episodes, rewards], got shape {m.shape}")
    return m, None


def _one_key_order(rows: Sequence[Mapping[str, float]], names: list[str]) -> None:
    """Weights by position read dict rows in their key order, so it must be one order in
    every row; otherwise a weight would follow whichever row came first."""
    for i, row in enumerate(rows):
        if list(row) != names:
            raise ValueError(
                f"weights by position need the reward names in one order in every row: rewards[0] has "
                f"{names}, rewards[{i}] has {list(row)}; give weights by name ({{name: weight}} for {sorted(names)})")


def gdpo(
    rewards: Sequence[Mapping[str, float]] | Any,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    groups: Sequence[Hashable] | None = None,
    batch_norm: bool = True,
    eps: float = 1e-6,
) -> Any:
    """GDPO advantage per episode (see the module docstring).

    ``rewards`` is a list of ``{name: value}`` dicts (one per episode) or a
    2-D ``[episodes, rewards]`` array or tensor. ``weights`` is a dict by name
    (dict rows) or a sequence by column (for dict rows: in their key order, which
    must then be the same in every row); all 1 when omitted. ``groups[i]`` is
    episode ``i``'s group id; without it the whole input is one group.
    Returns a list for list input, else an array or tensor like the input.
    """
    m, names = _matrix(rewards)
    n, k = m.shape
    if not np.all(np.isfinite(m)):
        raise ValueError("rewards must be finite")
    if weights is None:
        w = np.ones(k)
    elif isinstance(weights, Mapping):
        if names is None or set(weights) != set(names):
            raise ValueError(f"weights keys {sorted(weights)} must match the reward names {names}")
        w = np.array([float(weights[name]) for name in names])
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (k,):
            raise ValueError(f"weights must have {k} entries, got {w.shape}")
        if names is not None:
            _one_key_order(rewards, names)
    if groups is None:
        groups = [0] * n
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} ids for {n} episodes")
    per_reward = np.zeros_like(m)
    for g in dict.fromkeys(groups):
        rows = np.array([gi == g for gi in groups])
        for j in range(k):
            per_reward[rows, j] = _center_scale(m[rows, j], "std", eps)
    # weights near 1e308 would overflow the sum: sum with them scaled by a power of two (exact)
    w_scaled, e = _scaled(w)
    combined = per_reward @ w_scaled if k else np.zeros(n)
    if batch_norm:
        combined = _center_scale(combined, "std", math.ldexp(eps, -e))
    else:
        combined = _unscaled(combined, e, w, "weights")
    like = rewards if not (names or isinstance(rewards, list)) else []
    return _like(combined, like)
