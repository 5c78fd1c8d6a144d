"""Policy losses: PPO-clip and its off-policy corrections, KL and entropy terms.

One job: turn per-token logprobs, advantages and masks into a scalar loss plus
stats. Every tensor is ``[B, T]`` with ``mask`` 1 on action tokens (the tokens
the policy sampled) and 0 on context and padding. Nothing here knows where the
tokens came from; ``policy_loss`` at the bottom is the one place the pieces are
put together, in this order:

    keep  = mask & staleness_mask & m2po_mask        which tokens count at all
    loss  = agg( tis_weight * ppo_clip_token )        the policy-gradient term
          + kl_coef * agg( kl )  - entropy_coef * agg( entropy )

Three logprobs of the same token appear, and their names are kept apart:
``logprobs`` (the policy being trained, with gradients), ``old_logprobs`` (the
trainer's own logprobs before this update, the PPO anchor) and
``behaviour_logprobs`` (what the sampler reported: another engine, maybe older
weights). The gap between the last two is the off-policy mismatch that TIS and
M2PO correct.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AGGREGATIONS",
    "PolicyLossConfig",
    "aggregate",
    "entropy_bonus",
    "kl_penalty",
    "kl_per_token",
    "m2po_mask",
    "mismatch_stats",
    "policy_loss",
    "ppo_clip_loss",
    "ppo_clip_token_loss",
    "staleness_mask",
    "tis_weights",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------- aggregation


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", *,
              seq_ids: torch.Tensor | None = None, norm_len: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` over the tokens where ``mask`` is set.

    - ``token-mean``: every token weighs the same, ``sum(v * m) / sum(m)``
      (DAPO, Yu et al. 2025, its "token-level policy gradient loss").
    - ``seq-mean-token-mean``: mean over tokens within a sequence, then over
      sequences (GRPO, Shao et al. 2024, Eq. 3).
    - ``seq-mean-token-sum-norm``: each sequence's token sum divided by a
      constant ``norm_len``, then the mean over sequences (Dr. GRPO, Liu et al.
      2025, "Understanding R1-Zero-Like Training": no per-sequence length
      normalisation, so long wrong answers are not favoured).

    A sequence is a row, or, for packed rows, the tokens sharing a ``seq_ids``
    value (``[B, T]`` integers, any labels). Sequences with no masked token are
    left out of the sequence mean. An all-zero mask gives 0 (with a graph).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    m = mask.to(values.dtype)
    if agg == "token-mean":
        return (values * m).sum() / m.sum().clamp(min=1.0)
    if seq_ids is None:
        seq_ids = torch.arange(values.shape[0], device=values.device)[:, None].expand_as(values)
    elif seq_ids.shape != values.shape:
        raise ValueError(f"seq_ids must have the shape of values {tuple(values.shape)}, "
                         f"got {tuple(seq_ids.shape)}")
    _, seq = torch.unique(seq_ids.flatten(), return_inverse=True)
    n_seq = int(seq.max()) + 1 if seq.numel() else 0
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, seq, (values * m).flatten())
    counts = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, seq, m.flatten())
    present = counts > 0
    if agg == "seq-mean-token-mean":
        per_seq = sums[present] / counts[present]
    else:
        if norm_len is None or norm_len <= 0:
            raise ValueError("agg='seq-mean-token-sum-norm' needs norm_len > 0 "
                             "(Dr. GRPO divides by a constant, e.g. the max generation length)")
        per_seq = sums[present] / norm_len
    return per_seq.sum() / max(int(present.sum()), 1)


# --------------------------------------------------------------------------- PPO-clip


def ppo_clip_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28,
                        dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped-surrogate loss ``[B, T]`` (zero off the mask) and its stats.

    PPO (Schulman et al. 2017, Eq. 7), with the ratio ``r = exp(logprobs - old_logprobs)``:

        loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))

    Decoupled ranges are DAPO's clip-higher (Yu et al. 2025): a larger
    ``clip_high`` lets unlikely tokens with A > 0 grow further, against entropy
    collapse. ``dual_clip = c > 1`` adds dual-clip PPO (Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep RL"): for A < 0 the objective
    is ``max(min(r A, clip(r) A), c A)``, i.e. the loss is capped at ``-c A``, so a
    token whose ratio has grown huge (r > c) cannot dominate the batch.

    Stats (over masked tokens): ``clip_frac_low`` = A < 0 and r < 1 - clip_low,
    ``clip_frac_high`` = A > 0 and r > 1 + clip_high (the tokens whose gradient
    the clip removed), ``clip_frac_dual`` = A < 0 and r > c, ``approx_kl`` =
    mean of ``(r - 1) - log r`` (Schulman's k3 of KL(old || new)), ``ratio_mean``.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError("logprobs, old_logprobs, advantages and mask must share one [B, T] shape")
    if clip_low < 0 or clip_high < 0 or clip_low >= 1:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020 use 3), got {dual_clip}")
    m = mask.to(logprobs.dtype)
    A = advantages.detach().to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-A * ratio, -A * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        loss = torch.where(A < 0, torch.minimum(loss, -dual_clip * A), loss)
    loss = loss * m

    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        r = ratio.detach()
        stats = {
            "clip_frac_low": float((((A < 0) & (r < 1.0 - clip_low)) * m).sum() / n),
            "clip_frac_high": float((((A > 0) & (r > 1.0 + clip_high)) * m).sum() / n),
            "clip_frac_dual": (float((((A < 0) & (r > dual_clip)) * m).sum() / n)
                               if dual_clip is not None else 0.0),
            "approx_kl": float((((r - 1.0) - log_ratio.detach()) * m).sum() / n),
            "ratio_mean": float((r * m).sum() / n),
        }
    return loss, stats


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28,
                  dual_clip: float | None = None, agg: str = "token-mean",
                  seq_ids: torch.Tensor | None = None, norm_len: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar PPO-clip loss: ``ppo_clip_token_loss`` reduced by ``aggregate`` (see both)."""
    per_token, stats = ppo_clip_token_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low,
                                           clip_high=clip_high, dual_clip=dual_clip)
    loss = aggregate(per_token, mask, agg, seq_ids=seq_ids, norm_len=norm_len)
    stats["pg_loss"] = float(loss.detach())
    return loss, stats


# --------------------------------------------------------------------------- KL and entropy


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    Schulman (2020), "Approximating KL Divergence", with ``log r = ref - logprobs``:
    ``k1 = -log r`` (unbiased, can be negative), ``k2 = (log r)^2 / 2`` (biased,
    low variance), ``k3 = (r - 1) - log r`` (unbiased, always >= 0; the GRPO
    penalty, Shao et al. 2024, Eq. 4). The exponent is clamped to 20 so a
    far-off reference token cannot overflow k3.
    """
    log_r = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r.clamp(max=20.0)) - 1.0 - log_r
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
               estimator: str = "k1", *, agg: str = "token-mean",
               seq_ids: torch.Tensor | None = None, norm_len: float | None = None) -> torch.Tensor:
    """Scalar KL(pi || pi_ref) penalty: ``kl_per_token`` reduced by ``aggregate``."""
    return aggregate(kl_per_token(logprobs, ref_logprobs, estimator), mask, agg,
                     seq_ids=seq_ids, norm_len=norm_len)


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, *, agg: str = "token-mean",
                  seq_ids: torch.Tensor | None = None, norm_len: float | None = None) -> torch.Tensor:
    """Mean entropy of the policy over action tokens (the entropy bonus of A3C, Mnih et al. 2016).

    The loss subtracts ``entropy_coef`` times this, so a larger value lowers the loss.
    """
    return aggregate(entropies, mask, agg, seq_ids=seq_ids, norm_len=norm_len)


# --------------------------------------------------------------------------- off-policy corrections


def tis_weights(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                cap: float = 2.0) -> torch.Tensor:
    """Truncated importance-sampling weights, detached: ``min(exp(trainer - behaviour), cap)``.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (Eq. for TIS): the sampler's probabilities differ
    from the trainer's for the same weights (other kernels, other precision),
    so the policy gradient is reweighted by pi_trainer / pi_sampler, truncated at
    ``cap`` (their C) to bound the variance. ``trainer_logprobs`` are the
    trainer's pre-update (old) logprobs.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(trainer_logprobs.detach() - behaviour_logprobs.detach()).clamp(max=cap)


def staleness_mask(versions: torch.Tensor, current_version: int, max_staleness: int) -> torch.Tensor:
    """Boolean mask of tokens sampled at most ``max_staleness`` policy versions ago.

    The staleness bound of asynchronous RL (AReaL, Fu et al. 2025: a sample
    may be at most eta versions older than the policy it trains).
    Context tokens carry version -1 (see ``Episode.versions``) and come out
    False; the loss mask drops them anyway.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if (versions > current_version).any():
        raise ValueError(f"versions contain {int(versions.max())}, newer than "
                         f"current_version={current_version}")
    return (versions >= 0) & (current_version - versions <= max_staleness)


def m2po_mask(logratio: torch.Tensor, mask: torch.Tensor, tau: float = 0.04) -> torch.Tensor:
    """M2PO token mask: drop the most off-policy tokens until the second moment is <= ``tau``.

    M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy
    RL Reach with Stale Data on LLMs?"): with ``s_i = (log r_i)^2`` the
    squared log importance ratio of each masked token over the whole batch,
    M2 = mean(s). While M2 > tau, the token with the largest s is masked and
    M2 recomputed over the rest. Implemented exactly, in one sort: keep the
    ``m`` smallest s for the largest ``m`` whose mean is <= tau (the running
    mean of an ascending sort only grows, so the kept set is a prefix). Ties at
    the cut keep the earlier token. If even the smallest s exceeds tau, nothing
    is kept. Returns a boolean ``[B, T]`` mask (False off ``mask``).
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if logratio.shape != mask.shape:
        raise ValueError(f"logratio {tuple(logratio.shape)} and mask {tuple(mask.shape)} differ")
    on = mask.bool()
    s = logratio.detach().float()[on] ** 2
    order = torch.sort(s, stable=True).indices
    running_mean = s[order].cumsum(0) / torch.arange(1, s.numel() + 1, device=s.device)
    n_keep = int((running_mean <= tau).sum())
    kept = torch.zeros_like(s, dtype=torch.bool)
    kept[order[:n_keep]] = True
    out = torch.zeros_like(on)
    out[on] = kept
    return out


def mismatch_stats(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's logprobs are from the trainer's on the sampled tokens.

    ``mismatch_kl``: Schulman's k3 estimate of KL(sampler || trainer) from the
    sampler's own tokens, the mean of ``r - 1 - log r`` with ``r = exp(trainer -
    behaviour)`` (>= 0; Yao et al. 2025 track the same gap).
    ``max_abs_dlogprob``: the largest ``|trainer - behaviour|`` on one token.
    """
    on = mask.bool()
    if not on.any():
        return {"mismatch_kl": 0.0, "max_abs_dlogprob": 0.0}
    d = (trainer_logprobs.detach() - behaviour_logprobs.detach()).float()[on]
    return {"mismatch_kl": float((torch.exp(d) - 1.0 - d).mean()),
            "max_abs_dlogprob": float(d.abs().max())}


# --------------------------------------------------------------------------- the composed loss


class PolicyLossConfig(BaseModel):
    """Options of ``policy_loss``. Defaults: DAPO clip ranges, token-mean, no KL, no entropy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip range (ratio >= 1 - clip_low).")
    clip_high: float = Field(0.28, ge=0.0, description="PPO upper clip range, DAPO clip-higher.")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound c for A < 0; None = off.")
    agg: Aggregation = Field("token-mean", description="How per-token losses are reduced.")
    norm_len: float | None = Field(None, gt=0.0, description="Dr. GRPO constant for seq-mean-token-sum-norm.")
    tis_cap: float | None = Field(2.0, gt=0.0, description="Truncated IS cap C; None = no TIS.")
    max_staleness: int | None = Field(None, ge=0, description="Drop tokens more versions old; None = keep all.")
    m2po_tau: float | None = Field(None, ge=0.0, description="M2PO second-moment bound; None = off.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL(pi || pi_ref) penalty; 0 = off.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Schulman's KL estimator.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus; 0 = off.")


def policy_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: PolicyLossConfig | None = None, *, old_logprobs: torch.Tensor | None = None,
                behaviour_logprobs: torch.Tensor | None = None, versions: torch.Tensor | None = None,
                current_version: int | None = None, ref_logprobs: torch.Tensor | None = None,
                entropies: torch.Tensor | None = None, seq_ids: torch.Tensor | None = None,
                extra_per_token: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss: PPO-clip times TIS weights over the kept tokens, plus KL, minus entropy.

    ``old_logprobs`` defaults to ``logprobs.detach()`` (one update per batch:
    ratio 1, plain policy gradient). TIS is on by default but needs
    ``behaviour_logprobs``: without them (a fully on-policy batch) it is skipped
    and ``tis/on`` says 0. The options that are off by default fail loudly when
    switched on without their inputs: ``max_staleness`` needs ``versions`` and
    ``current_version``, ``m2po_tau`` needs ``behaviour_logprobs``, ``kl_coef``
    needs ``ref_logprobs``, ``entropy_coef`` needs ``entropies``. Tokens that
    staleness or M2PO drop leave the denominator of the mean too.
    ``extra_per_token`` (``[B, T]``, e.g. a distillation divergence) is added to
    the loss, aggregated like the policy term over the same kept tokens. Stats keys are
    namespaced: ``ppo/``, ``tis/``, ``mask/``, ``mismatch/``, ``loss/``.
    """
    cfg = cfg or PolicyLossConfig()
    old = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
    keep = mask.bool()
    stats: dict[str, float] = {}

    if cfg.max_staleness is not None:
        if versions is None or current_version is None:
            raise ValueError("max_staleness is set: pass versions and current_version")
        keep = keep & staleness_mask(versions, current_version, cfg.max_staleness)
    if cfg.m2po_tau is not None:
        if behaviour_logprobs is None:
            raise ValueError("m2po_tau is set: pass behaviour_logprobs")
        keep = keep & m2po_mask(old - behaviour_logprobs, keep, cfg.m2po_tau)
    if behaviour_logprobs is not None:
        stats.update({f"mismatch/{k}": v for k, v in mismatch_stats(old, behaviour_logprobs, mask).items()})
    stats["mask/kept_frac"] = float(keep.sum() / mask.bool().sum().clamp(min=1))

    per_token, ppo_stats = ppo_clip_token_loss(logprobs, old, advantages, keep, clip_low=cfg.clip_low,
                                               clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)
    stats.update({f"ppo/{k}": v for k, v in ppo_stats.items()})
    use_tis = cfg.tis_cap is not None and behaviour_logprobs is not None
    stats["tis/on"] = float(use_tis)
    if use_tis:
        w = tis_weights(old, behaviour_logprobs, cfg.tis_cap)
        per_token = per_token * w
        n = keep.sum().clamp(min=1)
        stats["tis/weight_mean"] = float((w * keep).sum() / n)
        stats["tis/capped_frac"] = float(((w >= cfg.tis_cap) & keep).sum() / n)

    reduce = {"agg": cfg.agg, "seq_ids": seq_ids, "norm_len": cfg.norm_len}
    loss = aggregate(per_token, keep, **reduce)
    stats["loss/pg"] = float(loss.detach())
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, keep, cfg.kl_estimator, **reduce)
        loss = loss + cfg.kl_coef * kl
        stats["loss/kl"] = float(kl.detach())
    if cfg.entropy_coef > 0:
        if entropies is None:
            raise ValueError("entropy_coef > 0 needs entropies")
        ent = entropy_bonus(entropies, keep, **reduce)
        loss = loss - cfg.entropy_coef * ent
        stats["loss/entropy"] = float(ent.detach())
    if extra_per_token is not None:
        extra = aggregate(extra_per_token, keep, **reduce)
        loss = loss + extra
        stats["loss/extra"] = float(extra.detach())
    stats["loss/total"] = float(loss.detach())
    return loss, stats
