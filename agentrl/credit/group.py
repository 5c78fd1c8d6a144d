"""Trajectory-level group baselines: one advantage per episode of a group.

A *group* is the episodes of one task. Each function takes the group's
episode rewards (a list, a numpy array or a torch tensor) and returns one
advantage per episode, in the same container type. Nothing here knows about
tokens: how an episode's advantage is spread over its tokens, and how the loss
is averaged, are decided by ``agentrl.credit.to_token_advantages`` and the
loss.

Conventions shared by every function here:

- The standard deviation is the *sample* one (Bessel-corrected, ``ddof=1``).
  DeepSeekMath (Shao et al. 2024, Sec. 4.1.2) writes ``std(r)`` without saying
  which; the reference implementations its readers use (TRL's GRPOTrainer,
  verl's ``compute_grpo_outcome_advantage``) both call ``torch.std``, which is
  the sample std, so we follow them.
- A group of one episode has no baseline: its advantage is 0.
- A group whose rewards are all equal gets exact zeros, never NaN, whatever
  ``eps`` is: float noise in its mean (``0.7 * 3`` sums to 2.0999999999999996)
  would otherwise leave advantages like 1e-10, which the trainer's
  ``skip_zero_advantage`` (``a == 0.0``) does not skip, or NaN with ``eps=0``.
- Rewards near float64's limit (1.8e308) work: the statistics are computed on
  the rewards divided by a power of two (``_scaled``, exact), where a group's
  sum, ``r - mean`` or the squares of its std cannot overflow. An advantage
  that is itself out of float64's range (one not divided by a std) raises a
  ``ValueError`` naming the rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["dr_grpo", "grpo", "mc_grpo", "mc_grpo_pivot", "rloo"]


# -- containers ----------------------------------------------------------------
def _array(x: Any, name: str = "rewards") -> np.ndarray:
    """``x`` as a 1-D float64 array; a clear error names ``name`` when it is not one."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().double().numpy()
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D sequence of numbers: {e}") from e
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite, got {a.tolist()}")
    return a


def _like(out: np.ndarray, like: Any) -> Any:
    """``out`` in the container type of ``like``: list, numpy array or torch tensor."""
    if type(like).__module__.startswith("torch"):
        import torch  # only when the caller already uses torch

        dtype = like.dtype if like.is_floating_point() else torch.float32
        return torch.as_tensor(out, dtype=dtype, device=like.device)
    if isinstance(like, np.ndarray):
        return out
    return out.tolist()


def _scaled(a: np.ndarray) -> tuple[np.ndarray, int]:
    """``a / 2**e`` and ``e``, the power of two that brings ``a``'s largest magnitude into [0.5, 1).

    Scaling by a power of two only moves exponents, so it is exact: the mean, the std
    and ``a - mean`` of the scaled values are those of ``a``, scaled, to the bit; but
    sums of values below 1 cannot overflow where sums near 1e308 do.
    """
    peak = float(np.max(np.abs(a))) if a.size else 0.0
    e = math.frexp(peak)[1]
    return np.ldexp(a, -e), e


def _unscaled(x: np.ndarray, e: int, source: np.ndarray, name: str = "rewards") -> np.ndarray:
    """``x * 2**e``: an advantage computed on ``_scaled`` inputs, back in their units;
    a ``ValueError`` names the inputs (``source``, called ``name``) when it is past float64's range."""
    with np.errstate(over="ignore"):
        out = np.ldexp(x, e)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"the advantages of {name} {source.tolist()} overflow float64 (beyond "
                         f"{np.finfo(np.float64).max:.3g}): scale the {name} down")
    return out


def _sample_std(a: np.ndarray) -> float:
    """Bessel-corrected std; 0.0 for fewer than two values."""
    return float(a.std(ddof=1)) if a.size > 1 else 0.0


def _no_spread(a: np.ndarray) -> bool:
    """Whether ``a`` has fewer than two values, or all of them equal: nothing to compare."""
    return a.size < 2 or bool(a.min() == a.max())


def _center_scale(a: np.ndarray, scale: str = "std", eps: float = 1e-6) -> np.ndarray:
    """``(a - mean) / (std + eps)`` (``scale="std"``) or ``a - mean`` (``"none"``).

    The shared core of GRPO-style normalisation. A group of one, or of equal
    values, gets exact zeros (see the module docstring).
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', not {scale!r}")
    if _no_spread(a):
        return np.zeros_like(a)
    s, e = _scaled(a)  # (a - mean) / (std + eps) = (s - mean_s) / (std_s + eps / 2**e)
    d = s - s.mean()
    return d / (_sample_std(s) + math.ldexp(eps, -e)) if scale == "std" else _unscaled(d, e, a)


# -- estimators ------------------------------------------------------------------
def grpo(rewards: Sequence[float], eps: float = 1e-6) -> Any:
    """GRPO outcome advantage: ``A_i = (r_i - mean(r)) / (std(r) + eps)``.

    Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2 (outcome supervision):
    ``Â_{i,t} = r̃_i = (r_i - mean(r)) / std(r)``, the same for every token of
    output ``i``. ``std`` is the sample std (see the module docstring); ``eps``
    keeps an all-equal group at 0 instead of NaN.
    """
    a = _array(rewards)
    return _like(_center_scale(a, "std", eps), rewards)


def dr_grpo(rewards: Sequence[float]) -> Any:
    """Dr. GRPO advantage: ``A_i = r_i - mean(r)``, with no division by the std.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective" (the Dr. GRPO objective). Dr. GRPO removes two
    biases of GRPO: the std division here (question-difficulty bias) and the
    per-response ``1/|o_i|`` length normalisation. The second one is a loss
    aggregation matter, not an advantage one: pair this estimator with a loss
    that sums token terms per sequence and divides by a constant
    (``loss_agg_mode="seq-mean-token-sum-norm"`` in verl's naming), not with a
    per-sequence token mean.
    """
    a = _array(rewards)
    return _like(_center_scale(a, "none"), rewards)


def rloo(rewards: Sequence[float]) -> Any:
    """REINFORCE leave-one-out: ``A_i = r_i - (1/(k-1)) * sum_{j != i} r_j``.

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    used for LLMs by Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs". Each episode's baseline is the mean of the *other*
    episodes, so it does not depend on the episode itself (unbiased).
    Equivalently ``k/(k-1) * (r_i - mean(r))``. A group of one gets 0.
    """
    a = _array(rewards)
    if _no_spread(a):
        return _like(np.zeros_like(a), rewards)
    s, e = _scaled(a)  # a.sum() overflows near 1e308
    return _like(_unscaled(s - (s.sum() - s) / (a.size - 1), e, a), rewards)


def mc_grpo_pivot(rewards: Sequence[float]) -> int | None:
    """Index of MC-GRPO's pivot rollout: the median element of an odd group, else None.

    Ties are broken by position (a stable sort), so exactly one rollout is the
    pivot even when several have the median reward.
    """
    a = _array(rewards)
    if a.size % 2 == 0:
        return None
    return int(np.argsort(a, kind="stable")[a.size // 2])


def mc_grpo(rewards: Sequence[float], scale: str = "std", eps: float = 1e-6) -> Any:
    """MC-GRPO: the median replaces the mean as the baseline; the pivot gets 0.

    Kim 2026, "MC-GRPO: Median-Centered Group Relative Policy Optimization for
    Small-Rollout Reinforcement Learning" (arXiv 2601.22582): sample
    ``G+1`` rollouts (an odd group), take ``A_i = (r_i - median(r)) / F``, and
    leave the median rollout (the *pivot*, whose advantage is exactly 0) out of
    backpropagation, so ``G`` rollouts carry gradient.

    What this function does, exactly:

    - baseline: ``median(r)`` over the whole group, pivot included (for an
      even group, numpy's median, the mean of the two middle values; there is
      then no pivot);
    - scale ``F``: the sample std of the whole group plus ``eps`` (``"std"``,
      as in GRPO) or 1 (``"none"``, as in Dr. GRPO), since the paper applies
      the median centring to several GRPO-family losses;
    - the pivot's advantage is 0. Excluding it from the loss is the caller's
      job: ``mc_grpo_pivot`` names it, and ``agentrl.credit.assign`` drops it.
    """
    a = _array(rewards)
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', not {scale!r}")
    if _no_spread(a):
        return _like(np.zeros_like(a), rewards)
    s, e = _scaled(a)  # as in _center_scale
    d = s - np.median(s)
    out = d / (_sample_std(s) + math.ldexp(eps, -e)) if scale == "std" else _unscaled(d, e, a)
    pivot = mc_grpo_pivot(a)
    if pivot is not None:
        out[pivot] = 0.0  # already 0 up to float error; make it exact
    return _like(out, rewards)
