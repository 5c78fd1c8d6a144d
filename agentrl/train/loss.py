"""Policy losses: PPO-clip and its off-policy corrections, M2PO, KL and entropy terms.

One job: turn per-token logprobs, advantages and masks into a scalar loss plus
stats. Every tensor is ``[B, T]`` with ``mask`` 1 on action tokens (the tokens
the policy sampled) and 0 on context and padding. Nothing here knows where the
tokens came from; ``policy_loss`` at the bottom is the one place the pieces are
put together, in this order:

    count = mask & staleness_mask                    which tokens count at all
    keep  = count & m2po_mask                        which carry a policy-gradient term
    loss  = agg( tis_weight * ppo_clip_token )  over count, zero off keep
            (with M2PO: agg( -keep * r * A ), r = pi / pi_behav, no clip, no TIS)
          + kl_coef * agg( kl )  - entropy_coef * agg( entropy )   over count

Which tokens count, and what the means divide by, is a property of a whole
minibatch, not of one forward pass over part of it: ``token_masks`` decides
them over the minibatch's tokens (M2PO's second moment is a batch statistic),
and ``policy_loss`` takes that decision (``masks``) for the row it is given, so
the loss does not depend on how the trainer packs rows.

Three logprobs of the same token appear, and their names are kept apart:
``logprobs`` (the policy being trained, with gradients), ``old_logprobs`` (the
trainer's own logprobs before this update, the PPO anchor) and
``behaviour_logprobs`` (what the sampler reported: another engine, maybe older
weights). The gap between the last two is the off-policy mismatch that TIS
corrects; M2PO reweights by the whole gap between the trained policy and the
sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..config import moved_keys
from ..strict import StrictModel
from .m2po import m2po_mask, m2po_token_loss, m2po_trust_region

__all__ = [
    "AGGREGATIONS",
    "PolicyLossConfig",
    "StepLoss",
    "TokenMasks",
    "aggregate",
    "entropy_bonus",
    "kl_penalty",
    "kl_per_token",
    "mean_denominator",
    "mismatch_stats",
    "policy_loss",
    "ppo_clip_loss",
    "ppo_clip_token_loss",
    "row_loss",
    "staleness_mask",
    "tis_weights",
    "token_masks",
    "weight_negatives",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------- aggregation


def _seq_labels(values: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
    if seq_ids is None:
        return torch.arange(values.shape[0], device=values.device)[:, None].expand_as(values)
    if seq_ids.shape != values.shape:
        raise ValueError(f"seq_ids must have the shape of values {tuple(values.shape)}, "
                         f"got {tuple(seq_ids.shape)}")
    return seq_ids


def mean_denominator(mask: torch.Tensor, agg: str = "token-mean", seq_ids: torch.Tensor | None = None) -> float:
    """What ``aggregate`` divides by over ``mask``: its tokens (``token-mean``), or the
    sequences with at least one of them (the sequence means)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    on = mask.bool()
    if agg == "token-mean":
        return float(on.sum())
    return float(torch.unique(_seq_labels(on, seq_ids)[on]).numel())


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", *,
              seq_ids: torch.Tensor | None = None, norm_len: float | None = None,
              denominator: float | None = None) -> torch.Tensor:
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
    left out of the sequence mean. ``denominator`` replaces the last division's
    (``sum(m)``, or the number of sequences): a caller that splits a batch into
    parts passes the batch's own (``mean_denominator``), so the parts add up to
    the batch's mean. A sequence's own token mean needs the whole sequence in
    one call. An all-zero mask gives 0 (with a graph).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    m = mask.to(values.dtype)
    if agg == "token-mean":
        total = (values * m).sum()
        return total / (denominator if denominator else m.sum().clamp(min=1.0))
    _, seq = torch.unique(_seq_labels(values, seq_ids).flatten(), return_inverse=True)
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
    return per_seq.sum() / (denominator if denominator else max(int(present.sum()), 1))


# --------------------------------------------------------------------------- PPO-clip


def weight_negatives(advantages: torch.Tensor, weight: float) -> torch.Tensor:
    """Negative advantages times ``weight``, positive ones unchanged.

    ``weight=0`` is positive sample reinforcement (PSR; Zhu et al. 2025, "The
    Surprising Effectiveness of Negative Reinforcement in LLM Reasoning", which
    splits the RLVR objective into a positive and a negative sample term): only
    above-average samples are pushed up, which in their runs sharpened pass@1 at
    the cost of pass@k; ``weight=1`` is the plain policy gradient (PSR + NSR).
    """
    if weight == 1.0:
        return advantages
    return torch.where(advantages < 0, advantages * weight, advantages)


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

    ``advantages`` may carry a last dimension ``[B, T, K]``: K advantages of one
    token (a token that several episodes share, tree rows, ``rows``), whose losses are
    summed: ``loss_t = sum_k loss(r_t, A_tk)``. The clip is per advantage, as it
    is per episode.

    Stats (over masked tokens): ``clip_frac_low`` = A < 0 and r < 1 - clip_low,
    ``clip_frac_high`` = A > 0 and r > 1 + clip_high (the tokens whose gradient
    the clip removed), ``clip_frac_dual`` = A < 0 and r > c, ``approx_kl`` =
    mean of ``(r - 1) - log r`` (Schulman's k3 of KL(old || new)), ``ratio_mean``.
    With K advantages a token counts when one of them does.
    """
    per_copy = advantages.dim() == logprobs.dim() + 1
    if not (logprobs.shape == old_logprobs.shape == mask.shape
            and advantages.shape[:logprobs.dim()] == logprobs.shape):
        raise ValueError("logprobs, old_logprobs, advantages and mask must share one [B, T] shape "
                         "(advantages may add a last dimension)")
    if clip_low < 0 or clip_high < 0 or clip_low >= 1:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020 use 3), got {dual_clip}")
    m = mask.to(logprobs.dtype)
    A = advantages.detach().to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    r = ratio[..., None] if per_copy else ratio
    loss = torch.maximum(-A * r, -A * r.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        loss = torch.where(A < 0, torch.minimum(loss, -dual_clip * A), loss)
    loss = (loss.sum(-1) if per_copy else loss) * m

    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        rd = ratio.detach()
        neg, pos = ((A < 0).any(-1), (A > 0).any(-1)) if per_copy else (A < 0, A > 0)
        stats = {
            "clip_frac_low": float(((neg & (rd < 1.0 - clip_low)) * m).sum() / n),
            "clip_frac_high": float(((pos & (rd > 1.0 + clip_high)) * m).sum() / n),
            "clip_frac_dual": (float(((neg & (rd > dual_clip)) * m).sum() / n)
                               if dual_clip is not None else 0.0),
            "approx_kl": float((((rd - 1.0) - log_ratio.detach()) * m).sum() / n),
            "ratio_mean": float((rd * m).sum() / n),
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

    As a *loss*, what counts is the expected gradient, and the three differ
    (Schulman's note is about the values; the gradients are worked out in
    Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation
    for RL"): with x ~ pi and the estimate differentiated through ``logprobs``,

    - ``E[grad k1] = E[grad log pi(x)] = 0``: no gradient in expectation;
    - ``E[grad k2] = E[log(pi/ref) grad log pi] = grad KL(pi || ref)``;
    - ``E[grad k3] = E[(1 - ref/pi) grad log pi] = grad KL(ref || pi)``, the
      other direction (mass-covering), although its value estimates KL(pi || ref).

    ``PolicyLossConfig`` refuses k1 as a loss term.
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
               estimator: str = "k3", *, agg: str = "token-mean", seq_ids: torch.Tensor | None = None,
               norm_len: float | None = None, denominator: float | None = None) -> torch.Tensor:
    """Scalar KL penalty: ``kl_per_token`` reduced by ``aggregate`` (which divergence its
    gradient minimises depends on the estimator: see ``kl_per_token``)."""
    return aggregate(kl_per_token(logprobs, ref_logprobs, estimator), mask, agg,
                     seq_ids=seq_ids, norm_len=norm_len, denominator=denominator)


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, *, agg: str = "token-mean",
                  seq_ids: torch.Tensor | None = None, norm_len: float | None = None,
                  denominator: float | None = None) -> torch.Tensor:
    """Mean entropy of the policy over action tokens (the entropy bonus of A3C, Mnih et al. 2016).

    The loss subtracts ``entropy_coef`` times this, so a larger value lowers the loss.
    """
    return aggregate(entropies, mask, agg, seq_ids=seq_ids, norm_len=norm_len, denominator=denominator)


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
    t = trainer_logprobs.detach().float()[on]
    b = behaviour_logprobs.detach().float()[on]
    d = torch.where(t == b, 0.0, t - b)  # both -inf: they agree (-inf - -inf would be nan)
    # One side -inf: r - 1 - log r is +inf either way (exp(inf) - inf would be nan).
    k3 = torch.where(torch.isinf(t) ^ torch.isinf(b), torch.inf, torch.expm1(d) - d)
    return {"mismatch_kl": float(k3.mean()),
            "max_abs_dlogprob": float(d.abs().max())}


# --------------------------------------------------------------------------- the composed loss


class PolicyLossConfig(StrictModel):
    """Options of ``policy_loss``. Defaults: DAPO clip ranges, token-mean, no KL, no entropy."""

    model_config = ConfigDict(frozen=True)

    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO lower clip range (ratio >= 1 - clip_low).")
    clip_high: float = Field(0.28, ge=0.0, description="PPO upper clip range, DAPO clip-higher.")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound c for A < 0; None = off.")
    agg: Aggregation = Field("token-mean", description="How per-token losses are reduced, over the "
                             "minibatch's kept tokens (or sequences), whatever the packing.")
    norm_len: float | None = Field(None, gt=0.0, description="Dr. GRPO constant for seq-mean-token-sum-norm.")
    tis_cap: float | None = Field(2.0, gt=0.0, description="Truncated IS cap C; None = no TIS. "
                                  "Not applied with m2po_tau, whose ratio is pi / pi_behav uncapped.")
    max_token_staleness: int | None = Field(
        None, ge=0, description="Drop single tokens more policy versions old than this from every term "
        "and every mean; None = keep all. (Whole batches: train.asynchronous.max_batch_staleness.) "
        "Was max_staleness.")
    m2po_tau: float | None = Field(
        None, ge=0.0, description="M2PO (Zheng et al. 2025, Algorithm 1) in place of PPO-clip and "
        "TIS: the loss is -M r A, r = pi / pi_behav, averaged over all tokens, where M masks the "
        "trust-region tokens (A > 0 and r > 1, or A < 0 and r < 1) with the largest (log r)^2 until "
        "their mean over the minibatch is <= m2po_tau (0.04 in the paper); None = PPO-clip.")
    negative_weight: float = Field(
        1.0, ge=0.0, le=1.0, description="Scale of negative advantages in the policy term "
        "(weight_negatives): 1 = plain; 0 = positive samples only (PSR, Zhu et al. 2025).")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL penalty to the reference; 0 = off.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Schulman's estimator of KL(pi || ref) used as the penalty; what its "
        "gradient minimises, in expectation over sampled tokens: k3, KL(ref || pi) (the GRPO "
        "penalty); k2, KL(pi || ref); k1, nothing (E[grad k1] = 0), so it is refused with kl_coef > 0.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus; 0 = off.")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return moved_keys(data, {"max_staleness": "max_token_staleness"}, "train.loss")

    @field_validator("kl_estimator")
    @classmethod
    def _k1_is_no_loss(cls, v: str, info: ValidationInfo) -> str:
        if v == "k1" and info.data.get("kl_coef", 0.0) > 0:
            raise ValueError("k1 as a loss term adds no gradient in expectation (E[grad k1] = "
                             "E[grad log pi] = 0 over sampled tokens): use k2 (its gradient is that of "
                             "KL(pi || ref)) or k3 (KL(ref || pi), the GRPO penalty)")
        return v


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """Which tokens ``policy_loss`` counts, decided once for a whole batch (``token_masks``).

    ``count``: the action tokens its means run over (those staleness keeps); ``keep``:
    those that carry a policy-gradient term (``count`` less M2PO's masked tokens);
    ``denominator``: what the means divide by (``mean_denominator`` of the batch's
    ``count``); ``stats``: M2PO's, over the batch.
    """

    count: torch.Tensor
    keep: torch.Tensor
    denominator: float
    stats: dict[str, float] = field(default_factory=dict)


def token_masks(cfg: PolicyLossConfig, mask: torch.Tensor, *, versions: torch.Tensor | None = None,
                current_version: int | None = None, logprobs: torch.Tensor | None = None,
                behaviour_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                seq_ids: torch.Tensor | None = None) -> TokenMasks:
    """``policy_loss``'s kept tokens and the denominator of its means, over the tokens given.

    Give it a whole minibatch (e.g. flattened to ``[1, N]`` with ``seq_ids`` per
    sample) and cut ``count`` and ``keep`` to each row: the loss is then the
    minibatch's, however its rows are packed. ``logprobs`` (the trained policy's,
    detached) are read by M2PO only. The M2PO stats: ``m2po/trust_region_frac``
    and ``m2po/masked_frac`` (of the counted tokens), ``m2po/m2`` and
    ``m2po/m2_kept`` (the trust-region mean of (log r)^2 before and after masking).
    """
    count = mask.bool()
    if cfg.max_token_staleness is not None:
        if versions is None or current_version is None:
            raise ValueError("max_token_staleness is set: pass versions and current_version")
        count = count & staleness_mask(versions, current_version, cfg.max_token_staleness)
    keep, stats = count, {}
    if cfg.m2po_tau is not None:
        if behaviour_logprobs is None or logprobs is None or advantages is None:
            raise ValueError("m2po_tau is set: pass behaviour_logprobs (and logprobs, advantages)")
        log_r = logprobs.detach() - behaviour_logprobs.detach()
        keep = m2po_mask(log_r, advantages, count, cfg.m2po_tau)
        tr = m2po_trust_region(log_r, advantages, count)
        s, n = log_r.float() ** 2, max(int(count.sum()), 1)
        stats = {"m2po/trust_region_frac": int(tr.sum()) / n,
                 "m2po/masked_frac": int((count & ~keep).sum()) / n,
                 "m2po/m2": float(s[tr].mean()) if tr.any() else 0.0,
                 "m2po/m2_kept": float(s[tr & keep].mean()) if (tr & keep).any() else 0.0}
    return TokenMasks(count, keep, mean_denominator(count, cfg.agg, seq_ids), stats)


def policy_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: PolicyLossConfig | None = None, *, old_logprobs: torch.Tensor | None = None,
                behaviour_logprobs: torch.Tensor | None = None, versions: torch.Tensor | None = None,
                current_version: int | None = None, ref_logprobs: torch.Tensor | None = None,
                entropies: torch.Tensor | None = None, seq_ids: torch.Tensor | None = None,
                extra_per_token: torch.Tensor | None = None,
                masks: TokenMasks | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss: PPO-clip times TIS weights (or M2PO) over the kept tokens, plus KL, minus entropy.

    ``old_logprobs`` defaults to ``logprobs.detach()`` (one update per batch:
    ratio 1, plain policy gradient). TIS is on by default but needs
    ``behaviour_logprobs``: without them (a fully on-policy batch) it is skipped
    and ``tis/on`` says 0. The options that are off by default fail loudly when
    switched on without their inputs: ``max_token_staleness`` needs ``versions`` and
    ``current_version``, ``m2po_tau`` needs ``behaviour_logprobs``, ``kl_coef``
    needs ``ref_logprobs``, ``entropy_coef`` needs ``entropies``.

    Which tokens count and what the means divide by come from ``masks``
    (``token_masks`` over a whole minibatch, cut to these tokens, with the
    denominator the caller's part of the minibatch's); without them they are
    decided over the tokens given. Stale tokens leave every term and every
    mean. M2PO (``m2po_tau``) replaces PPO-clip and TIS by ``m2po_token_loss``:
    its masked tokens lose their policy-gradient term but stay in the mean, which
    is over all tokens as in the paper; the KL, entropy and extra terms keep them.
    ``extra_per_token`` (``[B, T]``, e.g. a distillation divergence) is added to
    the loss, aggregated like the policy term. ``advantages`` may carry a last
    dimension of several advantages per token (``ppo_clip_token_loss``). Stats keys
    are namespaced: ``ppo/``, ``m2po/``, ``tis/``, ``mask/``, ``mismatch/``, ``loss/``.
    """
    cfg = cfg or PolicyLossConfig()
    advantages = weight_negatives(advantages, cfg.negative_weight)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
    if masks is None:
        masks = token_masks(cfg, mask, versions=versions, current_version=current_version, logprobs=logprobs,
                            behaviour_logprobs=behaviour_logprobs, advantages=advantages, seq_ids=seq_ids)
    on = mask.bool()
    count, keep = masks.count & on, masks.keep & on
    stats: dict[str, float] = dict(masks.stats)
    if behaviour_logprobs is not None:
        stats.update({f"mismatch/{k}": v for k, v in mismatch_stats(old, behaviour_logprobs, mask).items()})
    stats["mask/kept_frac"] = float(keep.sum() / on.sum().clamp(min=1))

    use_tis = cfg.tis_cap is not None and behaviour_logprobs is not None and cfg.m2po_tau is None
    stats["tis/on"] = float(use_tis)
    if cfg.m2po_tau is not None:
        if behaviour_logprobs is None:
            raise ValueError("m2po_tau is set: pass behaviour_logprobs")
        per_token = m2po_token_loss(logprobs, behaviour_logprobs, advantages, keep)
        with torch.no_grad():
            ratio = torch.exp(logprobs - behaviour_logprobs)[keep]  # masked ratios may be inf
            stats["m2po/ratio_mean"] = float(ratio.mean()) if ratio.numel() else 0.0
    else:
        per_token, ppo_stats = ppo_clip_token_loss(logprobs, old, advantages, keep, clip_low=cfg.clip_low,
                                                   clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)
        stats.update({f"ppo/{k}": v for k, v in ppo_stats.items()})
        if use_tis:
            assert cfg.tis_cap is not None and behaviour_logprobs is not None
            w = tis_weights(old, behaviour_logprobs, cfg.tis_cap)
            per_token = per_token * w
            n = keep.sum().clamp(min=1)
            stats["tis/weight_mean"] = float((w * keep).sum() / n)
            stats["tis/capped_frac"] = float(((w >= cfg.tis_cap) & keep).sum() / n)

    reduce = {"agg": cfg.agg, "seq_ids": seq_ids, "norm_len": cfg.norm_len, "denominator": masks.denominator}
    loss = aggregate(per_token, count, **reduce)  # zero off keep; M2PO's masked tokens still count
    stats["loss/pg"] = float(loss.detach())
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, count, cfg.kl_estimator, **reduce)
        loss = loss + cfg.kl_coef * kl
        stats["loss/kl"] = float(kl.detach())
    if cfg.entropy_coef > 0:
        if entropies is None:
            raise ValueError("entropy_coef > 0 needs entropies")
        ent = entropy_bonus(entropies, count, **reduce)
        loss = loss - cfg.entropy_coef * ent
        stats["loss/entropy"] = float(ent.detach())
    if extra_per_token is not None:
        extra = aggregate(extra_per_token, count, **reduce)
        loss = loss + extra
        stats["loss/extra"] = float(extra.detach())
    stats["loss/total"] = float(loss.detach())
    return loss, stats


# --------------------------------------------------------------------------- the step's loss


@dataclass(frozen=True, slots=True)
class StepLoss:
    """What the minibatch loop minimises: ``policy_loss`` under ``policy`` at policy ``version``,
    plus the distribution-level distillation term when ``distill_signal`` is set; or, with no
    ``policy``, SFT's token-mean NLL of the action tokens."""

    policy: PolicyLossConfig | None = None
    version: int = 0
    distill_signal: str | None = None
    jsd_beta: float = 0.5


def row_loss(logprobs: torch.Tensor, entropies: torch.Tensor, row: Any,
             spec: StepLoss) -> tuple[torch.Tensor, dict[str, float]]:
    """One row's loss and stats: ``row.values`` hold its per-token fields, ``row.minibatch``
    decides its kept tokens over the whole minibatch (``token_masks``)."""
    v = row.values
    if spec.policy is None:  # SFT: A = 1 on the expert's tokens, no ratio
        nll = aggregate(-logprobs, row.mask, "token-mean")
        return nll, {"sft/nll": float(nll.detach())}
    extra, d_stats = None, {}
    if "support_student" in v:  # distribution-level distillation: a per-token loss term
        from .distill.signals import distribution_loss

        extra, d_stats = distribution_loss(v["support_student"], v["support_teacher"], v["support"] >= 0,
                                           v["distill_weights"], row.mask, spec.distill_signal, spec.jsd_beta)
    masks = row.minibatch.token_masks(spec.policy, spec.version, row) if row.minibatch is not None else None
    loss, stats = policy_loss(logprobs, v["advantages"], row.mask, spec.policy, old_logprobs=v.get("old"),
                              behaviour_logprobs=v["behaviour"], versions=v["versions"],
                              current_version=spec.version, ref_logprobs=v.get("ref"), entropies=entropies,
                              seq_ids=row.seq_ids, extra_per_token=extra, masks=masks)
    return loss, {**stats, **d_stats}
