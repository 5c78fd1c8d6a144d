"""Step-wise on-policy distillation (OPD): per-token signals from a teacher that scores the student's own turns.

One job: given the student's and the teacher's log-probabilities on the
student's sampled tokens (or on a few candidate tokens per position), return
per-token distillation advantages, divergences and weights. The student
samples, the teacher scores what it sampled, and the student is pushed towards
the teacher where it went wrong (Agarwal et al. 2024, GKD; Lu and Thinking
Machines 2025, "On-Policy Distillation"). Everything here is a pure tensor
function; ``loop`` wires them into a rollout batch, and the trainer adds the
advantages to the RL ones and calls the losses in ``agentrl.train.loss``.

The pieces, each from the paper named in its docstring:

- the signal: ``reverse_kl_advantage`` (sampled tokens), ``topk_reverse_kl``,
  ``local_support_matching``, ``forward_kl``, ``jsd`` (distributions), on the
  support ``build_support`` picks, as a loss term (``distribution_loss``);
- where it counts: ``turn_balance_weights`` (per turn), ``overlap_stop``
  (Prune-OPD: stop where the student drifted), ``step_divergence_weights``
  (SOD), ``informative_token_mask`` (TIP);
- how it mixes with RL: ``combine_rl_and_distill``, ``linear_schedule``;
- a teacher without a model: ``expert_one_hot_teacher`` (a scripted expert on
  the sampled tokens).

Conventions: log-probabilities are natural logs; ``[..., K]`` tensors hold K
candidate tokens per position along the last axis; per-token outputs keep the
leading shape of their inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "OverlapStop",
    "build_support",
    "combine_rl_and_distill",
    "depth_budget",
    "distribution_loss",
    "expert_one_hot_teacher",
    "forward_kl",
    "informative_token_mask",
    "jsd",
    "linear_schedule",
    "local_support_matching",
    "overlap_stop",
    "reverse_kl_advantage",
    "spread_turn_values",
    "step_divergence_weights",
    "topk_reverse_kl",
    "turn_balance_weights",
]


# --------------------------------------------------------------------------- signals


def reverse_kl_advantage(student_lp: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """Per-token OPD advantage ``-(log pi_s(y_t) - log pi_t(y_t))`` on the student's sampled tokens, detached.

    Its expectation under the student is minus the per-token reverse KL,
    ``-KL(pi_s || pi_t)``; maximising it with the policy gradient (discount 0,
    no baseline needed) minimises the reverse KL (Agarwal et al. 2024, GKD,
    with the reverse-KL divergence; Lu and Thinking Machines 2025,
    "On-Policy Distillation", the per-token "negative reverse KL" reward).
    Positive where the teacher likes the token more than the student does.
    """
    if student_lp.shape != teacher_lp.shape:
        raise ValueError(f"student_lp {tuple(student_lp.shape)} and teacher_lp "
                         f"{tuple(teacher_lp.shape)} differ in shape")
    return (teacher_lp - student_lp).detach()


def _support(logprobs: torch.Tensor, k: int | None, special_mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean ``[..., K]``: the first ``k`` candidates that are not special tokens."""
    keep = torch.ones_like(logprobs, dtype=torch.bool)
    if k is not None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        keep[..., k:] = False
    if special_mask is not None:
        if special_mask.shape != logprobs.shape:
            raise ValueError(f"special_mask must have shape {tuple(logprobs.shape)}, "
                             f"got {tuple(special_mask.shape)}")
        keep &= ~special_mask.bool()
    return keep


def topk_reverse_kl(student_lp: torch.Tensor, teacher_lp: torch.Tensor, k: int | None = None,
                    special_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Top-K truncated reverse KL per position: ``sum_{i in S} p_s(i) (log p_s(i) - log p_t(i))``.

    ``student_lp`` and ``teacher_lp`` are ``[..., K]``: the full-vocabulary
    log-probs of both models at the student's top-K token ids (sorted, most
    likely first), so the teacher is scored on the same ids. S is the first
    ``k`` of them minus ``special_mask`` (True = a special token, such as
    end-of-turn or a tool-call tag, whose mass is a format decision more than a
    content one). The tail outside S is dropped, not renormalised: this is the
    truncated sum of the reverse KL of GKD (Agarwal et al. 2024) and of
    Thinking Machines' OPD, which approaches it as K grows, and it can be
    negative when the truncation cuts the teacher's mass. Differentiable in
    both inputs; pass the student with gradients to use it as a loss.
    """
    keep = _support(student_lp, k, special_mask)
    terms = student_lp.exp() * (student_lp - teacher_lp)
    return torch.where(keep, terms, torch.zeros_like(terms)).sum(-1)


def local_support_matching(student_lp: torch.Tensor, teacher_lp: torch.Tensor, k: int | None = None,
                           special_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reverse KL of both distributions renormalised on the shared local support S.

    With S as in ``topk_reverse_kl``, ``q_s = softmax_S(student_lp)`` and
    ``q_t = softmax_S(teacher_lp)`` (each model's probabilities restricted to S
    and rescaled to sum to 1), return ``KL(q_s || q_t) = sum_S q_s (log q_s - log q_t)``.
    Unlike the truncated sum it is a true divergence (>= 0, 0 iff the two agree
    in *relative* terms on S), blind to how much mass either model puts outside
    S: it matches the *shape* of the teacher's preferences among the student's
    own candidates, not their total mass. A position whose S is empty gives 0.
    """
    keep = _support(student_lp, k, special_mask)
    neg_inf = torch.full_like(student_lp, float("-inf"))
    qs = torch.log_softmax(torch.where(keep, student_lp, neg_inf), dim=-1)
    qt = torch.log_softmax(torch.where(keep, teacher_lp, neg_inf), dim=-1)
    terms = qs.exp() * (qs - qt)
    return torch.where(keep, terms, torch.zeros_like(terms)).nan_to_num(0.0).sum(-1)


def _xlogy_kl(p_lp: torch.Tensor, q_lp: torch.Tensor) -> torch.Tensor:
    """``sum p (log p - log q)`` along the last axis, with 0 log 0 = 0."""
    p = p_lp.exp()
    return torch.where(p > 0, p * (p_lp - q_lp), torch.zeros_like(p)).sum(-1)


def forward_kl(student_lp: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """``KL(pi_t || pi_s) = sum_v p_t(v) (log p_t(v) - log p_s(v))`` along the last axis.

    The mode-covering direction of supervised KD (Hinton et al. 2015) and of
    GKD's forward-KL variant (Agarwal et al. 2024). Over the full vocabulary it
    is the exact divergence; over top-K candidates it is the truncated sum (use
    ``local_support_matching``'s renormalisation for a proper divergence there).
    """
    return _xlogy_kl(teacher_lp, student_lp)


def jsd(student_lp: torch.Tensor, teacher_lp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024) along the last axis.

    ``JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture
    ``m = beta p_t + (1 - beta) p_s``. ``beta`` in (0, 1); it is 0 at both
    ends, where GKD switches to the plain KLs: use ``forward_kl`` or
    ``topk_reverse_kl`` / ``reverse_kl_advantage`` for those. Bounded by
    ``log 2`` at beta = 0.5, so one wild token cannot dominate.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}; use forward_kl / reverse KL at the ends")
    log_m = torch.logaddexp(teacher_lp + math.log(beta), student_lp + math.log(1.0 - beta))
    return beta * _xlogy_kl(teacher_lp, log_m) + (1.0 - beta) * _xlogy_kl(student_lp, log_m)


# --------------------------------------------------------------------------- weights


def spread_turn_values(turn_spans: list[tuple[int, int]], values: torch.Tensor | list[float],
                       length: int) -> torch.Tensor:
    """``[length]`` tensor with ``values[k]`` on every token of turn k (half-open spans) and 0 elsewhere."""
    values = torch.as_tensor(values, dtype=torch.float32)
    if values.numel() != len(turn_spans):
        raise ValueError(f"got {values.numel()} values for {len(turn_spans)} turns")
    out = torch.zeros(length)
    for (start, end), v in zip(turn_spans, values, strict=True):
        if not 0 <= start <= end <= length:
            raise ValueError(f"turn span {(start, end)} is outside [0, {length}]")
        out[start:end] = v
    return out


def turn_balance_weights(turn_spans: list[tuple[int, int]], progress: float, length: int) -> torch.Tensor:
    """Per-token weights ``[length]`` that move from token-balanced to turn-balanced as ``progress`` goes 0 -> 1.

    TurnOPD-style balancing (every turn one decision): a token of turn k with
    ``n_k`` action tokens gets ``w = (1 - progress) * 1 + progress / n_k``. At
    progress 0 each token weighs 1 (long turns dominate, as in plain
    token-level OPD); at 1 each turn sums to 1 (every decision of the agent
    counts the same, however many tokens it took). Tokens outside the spans
    (context) get 0. ``turn_spans`` are one episode's ``Episode.turn_spans``.
    """
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress must be in [0, 1], got {progress}")
    per_turn = [(1.0 - progress) + progress / max(end - start, 1) for start, end in turn_spans]
    return spread_turn_values(turn_spans, per_turn, length)


@dataclass(slots=True)
class OverlapStop:
    """Result of ``overlap_stop``: the stop index per row, weights and the per-position overlap."""

    index: torch.Tensor  # [B] first position whose overlap fell below the threshold; T if none
    weights: torch.Tensor  # [B, T] 1 up to and at the stop, after_weight after it
    overlap: torch.Tensor  # [B, T] fraction of the student's top-k the teacher also ranks top-k
    tokens_saved: int  # masked tokens after the stops: the teacher need not score them


def overlap_stop(student_topk_ids: torch.Tensor, teacher_topk_ids: torch.Tensor, threshold: float,
                 mask: torch.Tensor | None = None, after_weight: float = 0.0) -> OverlapStop:
    """Where the student's prefix drifted from the teacher: the first position whose top-k overlap < ``threshold``.

    Prune-OPD (Yang et al. 2026, arXiv 2605.07804): local compatibility is the
    top-k overlap ``|top_k(s) ∩ top_k(t)| / k`` at each position; once it falls
    below a threshold the teacher's later scores are no longer trustworthy, so
    they are down-weighted monotonically and the rollout can be truncated. This
    is the simplest such rule: weight 1 up to and including the first
    drifting position (its signal is still the teacher correcting the drift),
    ``after_weight`` for every position after it. ESR (Zhou et al. 2026, arXiv
    2605.27028) is the fixed-position special case: stop after the first N
    tokens whatever the overlap. Inputs are ``[B, T, k]`` (or ``[T, k]``) token
    ids; ``mask`` ``[B, T]`` marks the positions that count (action tokens);
    ``tokens_saved`` counts masked positions after the stop, the teacher
    forward that can be skipped when ``after_weight`` is 0.
    """
    squeeze = student_topk_ids.ndim == 2
    if squeeze:
        student_topk_ids, teacher_topk_ids = student_topk_ids[None], teacher_topk_ids[None]
        mask = None if mask is None else mask[None]
    if student_topk_ids.shape != teacher_topk_ids.shape or student_topk_ids.ndim != 3:
        raise ValueError("student_topk_ids and teacher_topk_ids must both be [B, T, k] (or [T, k])")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    batch, length, k = student_topk_ids.shape
    on = torch.ones(batch, length, dtype=torch.bool) if mask is None else mask.bool()
    shared = (student_topk_ids[..., :, None] == teacher_topk_ids[..., None, :]).any(-1)
    overlap = shared.float().sum(-1) / k
    drift = (overlap < threshold) & on
    positions = torch.arange(length).expand(batch, length)
    index = torch.where(drift, positions, torch.full_like(positions, length)).min(-1).values
    after = positions > index[:, None]
    weights = torch.where(after, torch.full_like(overlap, after_weight), torch.ones_like(overlap))
    saved = int((after & on).sum())
    if squeeze:
        return OverlapStop(index[0], weights[0], overlap[0], saved)
    return OverlapStop(index, weights, overlap, saved)


def depth_budget(turn_mass: Sequence[float], coverage: float, min_turns: int = 1) -> int:
    """TurnOPD's rollout-depth budget: the fewest turns whose divergence holds ``coverage`` of the total.

    ``turn_mass[k]`` is the teacher-student divergence summed over turn k+1's
    action tokens across the batch (so it shrinks both where the student already
    agrees with the teacher and where few episodes get that deep). Turns past
    the budget teach little per token generated, so the next rollouts stop
    there. At least ``min_turns``; all turns when there is no mass at all.
    """
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    total = float(sum(turn_mass))
    if total <= 0.0:
        return max(len(turn_mass), min_turns)
    running = 0.0
    for k, mass in enumerate(turn_mass, start=1):
        running += float(mass)
        if running >= coverage * total - 1e-12:
            return max(k, min_turns)
    return max(len(turn_mass), min_turns)


def step_divergence_weights(per_turn_divergence: torch.Tensor | list[float], alpha: float = 1.0
                            ) -> torch.Tensor:
    """Per-step weights ``w_k = exp(-alpha * d_k)`` that shrink as the step's teacher-student divergence grows.

    SOD (Zhong et al. 2026, "Step-wise On-policy Distillation for Small
    Language Model Agents", arXiv 2605.07725) reweights the distillation
    strength of each step (turn) by its step-level divergence, so that after a
    bad tool call, where the teacher's scores are off-distribution, the signal
    is attenuated, and restored when the student recovers. The weighting
    function here is our choice, not the paper's exact one: ``exp(-alpha d)``
    is 1 at d = 0, halves every ``ln 2 / alpha`` nats and never goes negative.
    ``d_k`` would be, e.g., the mean per-token reverse KL over turn k's tokens;
    spread to tokens with ``spread_turn_values``. Detached.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    d = torch.as_tensor(per_turn_divergence, dtype=torch.float32).detach()
    if (d < 0).any():
        raise ValueError("per_turn_divergence must be >= 0 (a divergence)")
    return torch.exp(-alpha * d)


def informative_token_mask(student_entropy: torch.Tensor, divergence: torch.Tensor,
                           mask: torch.Tensor | None = None, high_entropy_q: float = 0.5,
                           low_entropy_q: float = 0.2, high_div_q: float = 0.8
                           ) -> tuple[torch.Tensor, float]:
    """TIP token selection: ``(keep [B, T], fraction kept)`` of the tokens worth distilling on.

    TIP (Xu et al. 2026, "Token Importance in On-Policy Distillation", arXiv
    2604.14084) finds the learning signal in two regions of the (student
    entropy, teacher-student divergence) plane: high student entropy (the
    student is unsure), and low entropy with high divergence (the student is
    confidently wrong). With quantiles taken over the masked tokens:

        keep = H >= q(H, high_entropy_q)  or  (H <= q(H, low_entropy_q) and D >= q(D, high_div_q))

    Only kept tokens need the vocabulary head and the teacher's scores, so
    activation memory of that part falls roughly with the kept fraction.
    """
    for name, q in (("high_entropy_q", high_entropy_q), ("low_entropy_q", low_entropy_q),
                    ("high_div_q", high_div_q)):
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {q}")
    if student_entropy.shape != divergence.shape:
        raise ValueError("student_entropy and divergence must share one shape")
    on = torch.ones_like(student_entropy, dtype=torch.bool) if mask is None else mask.bool()
    if not on.any():
        return torch.zeros_like(on), 0.0
    H, D = student_entropy.detach().float(), divergence.detach().float()
    h_hi = torch.quantile(H[on], high_entropy_q)
    h_lo = torch.quantile(H[on], low_entropy_q)
    d_hi = torch.quantile(D[on], high_div_q)
    keep = on & ((H >= h_hi) | ((H <= h_lo) & (D >= d_hi)))
    return keep, float(keep.sum() / on.sum())


# --------------------------------------------------------------------------- distribution-level losses


def build_support(student_top: torch.Tensor, teacher_at_student: torch.Tensor, teacher_top: torch.Tensor,
                  teacher_top_lp: torch.Tensor, *, both: bool, special: torch.Tensor | None = None,
                  vocab: int | None = None, allowed: dict[int, list[int]] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate ids ``[T, C]`` a distribution-level signal compares on, and the teacher's log-probs there.

    The student's top-K ids (``student_top``, with ``teacher_at_student`` the
    teacher's log-probs of them); with ``both``, then the teacher's own top-K
    (``teacher_top`` / ``teacher_top_lp``), an id the student already listed
    left out. Left-out ids, ``special`` ones and ids ``>= vocab`` are -1, and so
    are a constrained token's ids outside its ``allowed`` ones (``Sample.allowed``):
    a top-K taken under the sampler's mask lists them, with log-prob -inf on both
    sides, wherever fewer than K ids were allowed, and -inf - -inf is NaN.
    """
    ids, lp = student_top.clone(), teacher_at_student.clone()
    if both:
        dup = (teacher_top[..., :, None] == student_top[..., None, :]).any(-1)
        ids = torch.cat([ids, teacher_top.masked_fill(dup, -1)], dim=-1)
        lp = torch.cat([lp, teacher_top_lp], dim=-1)
    if special is not None:
        ids = ids.masked_fill(torch.isin(ids, special), -1)
    if vocab is not None:
        ids = ids.masked_fill(ids >= vocab, -1)
    for t, ok in (allowed or {}).items():
        ids[t] = ids[t].masked_fill(~torch.isin(ids[t], torch.tensor(ok, dtype=ids.dtype)), -1)
    return ids, lp


_LEFT_OUT = -1e4  # a log-prob whose probability is exactly 0 in float32, and finite: no NaN gradients


def distribution_loss(student_lp: torch.Tensor, teacher_lp: torch.Tensor, keep: torch.Tensor,
                      weights: torch.Tensor, mask: torch.Tensor, signal: str, jsd_beta: float = 0.5
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per action token ``w_t D_t``, ``D`` the ``signal`` divergence on the token's support: ``[B, T]``.

    ``student_lp`` / ``teacher_lp`` / ``keep`` are ``[B, T, C]`` (``build_support``'s
    ids gathered from both models, ``keep`` = id >= 0); ``weights`` and ``mask``
    ``[B, T]``. Left-out candidates become probability 0 on both sides. The
    policy loss aggregates the result like its own term (``extra_per_token``).
    Also returns ``loss/distill_<signal>``, the unweighted mean divergence.
    """
    s_lp = torch.where(keep, student_lp, _LEFT_OUT)
    t_lp = torch.where(keep, teacher_lp.to(student_lp.dtype), _LEFT_OUT)
    if signal == "topk_reverse_kl":
        per = topk_reverse_kl(s_lp, t_lp)
    elif signal == "lsm":
        per = local_support_matching(s_lp, t_lp)
    elif signal == "forward_kl":
        per = forward_kl(s_lp, t_lp)
    elif signal == "jsd":
        per = jsd(s_lp, t_lp, jsd_beta)
    else:
        raise ValueError(f"distribution_loss: {signal!r} is not a distribution-level signal")
    m = mask.to(per.dtype)
    mean = float((per.detach() * m).sum() / m.sum().clamp(min=1))
    return per * weights * m, {f"loss/distill_{signal}": mean}


# --------------------------------------------------------------------------- mixing with RL


def combine_rl_and_distill(rl_adv: torch.Tensor, distill_adv: torch.Tensor, weight: float) -> torch.Tensor:
    """Per-token advantage ``A = A_rl + weight * A_distill`` (dGRPO-style mixing).

    The environment's reward says whether the episode worked; the teacher
    says, token by token, how it would have acted. Adding the two advantages
    before the PPO loss is the same as a KL-to-teacher term whose strength is
    ``weight`` (Lu and Thinking Machines 2025 add the negative reverse KL to the
    reward the same way). Anneal ``weight`` with ``linear_schedule`` to start
    from imitation and end on the task reward.
    """
    if rl_adv.shape != distill_adv.shape:
        raise ValueError(f"rl_adv {tuple(rl_adv.shape)} and distill_adv {tuple(distill_adv.shape)} differ")
    return rl_adv + weight * distill_adv


def linear_schedule(step: int, start: float, end: float, steps: int) -> float:
    """``start`` at step 0, ``end`` from step ``steps`` on, linear in between."""
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    frac = min(max(step / steps, 0.0), 1.0)
    return start + (end - start) * frac


# --------------------------------------------------------------------------- experts as teachers


def expert_one_hot_teacher(action_token_ids: torch.Tensor | list[int], expert_token_ids: torch.Tensor | list[int],
                           floor: float = -10.0, prefix_only: bool = True) -> torch.Tensor:
    """Teacher log-probs ``[T]`` of a scripted expert: 0 where the student's token matches the expert's, ``floor`` elsewhere.

    A deterministic expert (ALFWorld's planner, a solver) is a one-hot policy
    over action *strings*. We approximate it over tokens: the expert's action
    is tokenized on its own (``expert_token_ids``) and compared position by
    position with the student's sampled ``action_token_ids``. The
    approximations, said plainly:

    - tokenization: the student may spell the same text with other tokens
      (``" go"`` vs ``" g" "o"``); it then gets ``floor`` from the first
      differing token although the text was right. Tokenize the expert action
      with the same tokenizer and the same leading-space convention as the
      chat template, and include the end-of-turn token if the student's
      action has one;
    - after a divergence a one-hot teacher gives every continuation
      probability 0, so with ``prefix_only`` (default) every token from the
      first mismatch on gets ``floor``; with ``prefix_only=False`` positions
      are compared independently, the literal position-aligned rule;
    - ``floor`` stands for log 0 and bounds the penalty: ``reverse_kl_advantage``
      gives ``floor - log pi_s`` there. Tokens beyond the expert's length get ``floor``.
    """
    action = torch.as_tensor(action_token_ids, dtype=torch.long)
    expert = torch.as_tensor(expert_token_ids, dtype=torch.long)
    if action.ndim != 1 or expert.ndim != 1:
        raise ValueError("action_token_ids and expert_token_ids must be 1D token lists")
    if floor >= 0:
        raise ValueError(f"floor must be < 0 (it stands for log 0), got {floor}")
    n = min(action.numel(), expert.numel())
    match = torch.zeros(action.numel(), dtype=torch.bool)
    match[:n] = action[:n] == expert[:n]
    if prefix_only:
        match = match.long().cumprod(0).bool()
    return torch.where(match, torch.zeros(action.numel()), torch.full((action.numel(),), floor))
