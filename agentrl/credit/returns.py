"""Per-turn returns, GAE over turns, and advantage normalisation.

Here a time step is a *turn* (one env step), not a token: ``rewards[t]`` is
the env reward of turn ``t``. The token-level spreading of a turn's value is
``agentrl.credit.to_token_advantages``' job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from agentrl.types import Episode

from .group import _array, _like, _no_spread, _scaled

__all__ = ["LEVELS", "discounted_returns", "episode_gae", "gae", "normalize"]

LEVELS = ("turn", "group", "batch", "mixed")


def _finite_returns(out: np.ndarray, rewards: np.ndarray) -> np.ndarray:
    """``out``, or a ``ValueError`` naming ``rewards`` when a sum of them overflowed float64."""
    if not np.all(np.isfinite(out)):
        raise ValueError(f"the returns of rewards {rewards.tolist()} overflow float64 (beyond "
                         f"{np.finfo(np.float64).max:.3g}): scale the rewards down")
    return out


def _check_unit(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def discounted_returns(rewards: Sequence[float], gamma: float = 1.0) -> Any:
    """``G_t = r_t + gamma * G_{t+1}`` with ``G_T = 0``: the return from each turn on.

    Sutton & Barto 2018, eq. 3.9. With a single terminal reward ``R`` at turn
    ``T-1`` this is ``gamma**(T-1-t) * R``.
    """
    _check_unit(gamma, "gamma")
    r = _array(rewards)
    out = np.zeros_like(r)
    running = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(r.size - 1, -1, -1):
            running = r[t] + gamma * running
            out[t] = running
    return _like(_finite_returns(out, r), rewards)


def gae(
    rewards: Sequence[float],
    values: Sequence[float] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    last_value: float = 0.0,
) -> Any:
    """Generalised advantage estimation over turns.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16:
    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)`` and
    ``A_t = sum_l (gamma * lam)**l * delta_{t+l}``, computed backwards as
    ``A_t = delta_t + gamma * lam * A_{t+1}``.

    ``values[t]`` is a value head's estimate of the state turn ``t`` acted in;
    ``last_value`` is ``V`` of the state after the last turn: 0 when the
    episode terminated, a bootstrap when it was truncated.

    Without a value head (``values=None``) this returns the discounted returns
    ``G_t`` (the REINFORCE target, i.e. ``V = 0`` and ``lam = 1``), whatever
    ``lam`` is: a group baseline is then the caller's business.
    """
    _check_unit(gamma, "gamma")
    _check_unit(lam, "lam")
    if values is None:
        return discounted_returns(rewards, gamma)
    r, v = _array(rewards), _array(values, "values")
    if v.size != r.size:
        raise ValueError(f"values has {v.size} entries but rewards has {r.size}")
    if not np.isfinite(last_value):  # it enters delta_{T-1}, and so every A_t
        raise ValueError(f"last_value must be finite, got {last_value}")
    out = np.zeros_like(r)
    next_value, running = float(last_value), 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(r.size - 1, -1, -1):
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            out[t] = running
            next_value = v[t]
    return _like(_finite_returns(out, r), rewards)


def episode_gae(e: Episode, value_fn: Callable[[Episode], Sequence[float]] | None, gamma: float,
                lam: float) -> Any:
    """``gae`` for one episode; ``value_fn`` may give one value more than turns: the bootstrap
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


def _whiten(x: np.ndarray, eps: float) -> np.ndarray:
    """``(x - mean) / (std + eps)`` with the population std; one value, or equal ones, give
    exact zeros (float noise in the mean is no signal, and eps = 0 would make 0/0).
    Computed on ``x`` scaled by a power of two, so values near 1e308 do not overflow."""
    if _no_spread(x):
        return np.zeros_like(x)
    s, e = _scaled(x)  # exact, and no overflow near 1e308 (see group._scaled)
    return (s - s.mean()) / (s.std() + math.ldexp(eps, -e))


def normalize(
    advs: Sequence[Sequence[float]],
    level: str = "batch",
    groups: Sequence[Hashable] | None = None,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Whiten per-turn advantages ``advs[episode][turn]`` at one level.

    Every turn counts once (no token weighting: that is the loss's business).
    Statistics use the population std (``ddof=0``), as whitening usually does.

    - ``"turn"``: over the turns with the same index ``t`` across the batch
      (turn 0 against turn 0, ...), so late turns, whose returns are discounted
      less, are not drowned by early ones.
    - ``"group"``: over all turns of the episodes of one group (``groups[i]``
      is episode ``i``'s group id, e.g. its task).
    - ``"batch"``: over all turns of the batch.
    - ``"mixed"``: the mean of the ``"group"`` and ``"batch"`` results, so a
      task whose advantages are all small keeps some of its own scale (group)
      while staying comparable across tasks (batch). This averaging is our
      choice; verl-agent/GiGPO do not define a "mixed" level.

    A set of one turn, or of equal values, gives zeros.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    rows = [_array(a, f"advs[{i}]") for i, a in enumerate(advs)]
    if level in ("group", "mixed"):
        if groups is None or len(groups) != len(rows):
            raise ValueError(f"level={level!r} needs groups: one group id per episode")
    if not rows:
        return []
    flat = np.concatenate(rows)
    episode_of = np.concatenate([np.full(r.size, i) for i, r in enumerate(rows)])
    turn_of = np.concatenate([np.arange(r.size) for r in rows])

    def by(keys: np.ndarray) -> np.ndarray:
        out = np.zeros_like(flat)
        for k in np.unique(keys):
            mask = keys == k
            out[mask] = _whiten(flat[mask], eps)
        return out

    if level == "turn":
        out = by(turn_of)
    elif level == "batch":
        out = _whiten(flat, eps)
    else:
        ids = {g: j for j, g in enumerate(dict.fromkeys(groups))}
        group_of = np.array([ids[groups[i]] for i in episode_of], dtype=np.int64)
        out = by(group_of)
        if level == "mixed":
            out = 0.5 * (out + _whiten(flat, eps))
    cuts = np.cumsum([r.size for r in rows])[:-1]
    return [part.tolist() for part in np.split(out, cuts)]
