"""The teacher's signal laid onto a batch's samples, one sample at a time, in place.

One job: turn the teacher's and the student's log-probs held in each
``Sample`` into what the loss reads. ``add_distill_advantages`` is the core
update, ``A_t = A_rl_t + w * w_t * (log pi_teacher - log pi_student)`` on every
action token (``signals.reverse_kl_advantage``, ``signals.combine_rl_and_distill``);
``expert_teacher_logprobs`` gives a scripted expert's one-hot log-probs on the
student's tokens; ``overlap_weights`` gives the overlap stop's per-token
weights. The pure tensor signals they call live in ``signals``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..batch import Sample
from .signals import (
    combine_rl_and_distill,
    expert_one_hot_teacher,
    overlap_stop,
    reverse_kl_advantage,
    spread_turn_values,
    step_divergence_weights,
    turn_balance_weights,
)

__all__ = ["add_distill_advantages", "expert_teacher_logprobs", "overlap_weights"]


def _stops_right_after(tokenizer: Any, rest: list[int], stop: Sequence[str]) -> bool:
    """Whether a stopped turn's tokens ``rest`` after the expert's text are its stop alone:
    special tokens (an end token) and white space, or one of the ``stop`` strings."""
    text = tokenizer.decode(rest, skip_special_tokens=True).strip()
    return text == "" or text in {s.strip() for s in stop}


def expert_teacher_logprobs(sample: Sample, tokenizer: Any, floor: float,
                            stop: Sequence[str] = ()) -> tuple[list[float], int, int]:
    """The teacher log-probs of a scripted expert, from ``sample.distill.expert_turns``; (logprobs,
    turns, matched turns).

    ``expert_turns`` holds ``(start, end, expert_action, stopped)`` per turn: the
    turn's action tokens are ``input_ids[start:end]``. A turn without an expert
    action gets the student's own logprobs (no signal). The expert's action is
    tokenized alone; when the student's turn stopped (a stop token or string,
    ``stop``: ``sampling.stop``) right after the expert's text, its stop tokens
    count as matching too. More text before the stop is another action: its
    tokens get ``floor``.
    """
    if sample.old is None:
        raise ValueError("the expert teacher needs sample.old (the student's logprobs) filled")
    teacher = list(sample.old)
    turns = matched = 0
    for start, end, expert, stopped in sample.distill.expert_turns or []:
        if expert is None or end <= start:
            continue
        action = list(sample.input_ids[start:end])
        want = tokenizer(expert, add_special_tokens=False)["input_ids"]
        if stopped and action[:len(want)] == want and _stops_right_after(tokenizer, action[len(want):], stop):
            want = action  # the expert's text, then the student's stop tokens
        lp = expert_one_hot_teacher(action, want, floor=floor).tolist()
        teacher[start:end] = lp
        turns += 1
        matched += int(all(x == 0.0 for x in lp))
    return teacher, turns, matched


def overlap_weights(samples: list[Sample], threshold: float, after_weight: float
                    ) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per sample, 1 up to its first action token whose top-k overlap < ``threshold``, ``after_weight`` after.

    Reads ``sample.old_top`` and ``sample.distill.teacher_top`` (``[T, K]`` ids); see
    ``overlap_stop``. Stats: the mean overlap over action tokens, the share of
    samples that stopped, and the action tokens after a stop.
    """
    weights, overlap, n_action, stopped, after = [], 0.0, 0, 0, 0
    for s in samples:
        mask = torch.tensor(s.mask, dtype=torch.bool)
        r = overlap_stop(torch.tensor(s.old_top), torch.tensor(s.distill.teacher_top), threshold, mask,
                         after_weight)
        weights.append(r.weights)
        overlap += float(r.overlap[mask].sum())
        n_action += int(mask.sum())
        stopped += int(r.index < len(s.mask))
        after += r.tokens_saved
    return weights, {"distill/overlap_mean": overlap / max(n_action, 1),
                     "distill/overlap_stopped_frac": stopped / max(len(samples), 1),
                     "distill/overlap_tokens_after_stop": after}


def add_distill_advantages(samples: list[Sample], weight: float, *, turn_balance: float | None = None,
                           sod_alpha: float | None = None, loss_weights: bool = False,
                           token_weights: Sequence[torch.Tensor] | None = None) -> float:
    """``A += weight * w_t * (log pi_t - log pi_s)`` on every action token, in place; returns the batch's KL estimate.

    ``sample.old`` holds the student's logprobs and ``sample.distill.teacher``
    the teacher's, aligned with ``input_ids``; context tokens keep their
    advantage. The sum is ``combine_rl_and_distill``.
    ``w_t`` is 1, times, when asked (both need ``sample.turn_spans``):

    - ``turn_balance`` = progress in [0, 1]: TurnOPD's move from token- to
      turn-balanced weights (``turn_balance_weights``);
    - ``sod_alpha``: SOD's per-turn ``exp(-alpha * d_k)``, ``d_k`` the mean
      ``|log pi_s - log pi_t|`` over turn k's action tokens, those TIP took out of the
      mask included (both models scored them; ``step_divergence_weights``).

    ``token_weights[i]`` multiplies sample i's ``w_t`` too (the overlap stop).
    With ``loss_weights`` the advantages are left alone and ``weight * w_t``
    goes to ``sample.distill.weights``: the weights of a distribution-level loss term.

    The returned value is the mean of ``log pi_s - log pi_t`` over all action
    tokens of the batch (k1 estimate of KL(pi_s || pi_t) on the sampled tokens).
    """
    gap_sum, n = 0.0, 0
    for i, s in enumerate(samples):
        if s.old is None or s.distill.teacher is None:
            raise ValueError("add_distill_advantages needs sample.old and sample.distill.teacher filled")
        mask = torch.tensor(s.mask, dtype=torch.bool)
        a_distill = reverse_kl_advantage(torch.tensor(s.old), torch.tensor(s.distill.teacher)) * mask
        gap_sum -= float(a_distill.sum())
        n += int(mask.sum())
        w = torch.ones(len(s.input_ids))
        if turn_balance is not None or sod_alpha is not None:
            spans = s.turn_spans
            if spans is None:
                raise ValueError("turn_balance and sod_alpha need sample.turn_spans")
            if turn_balance is not None:
                w = w * turn_balance_weights(spans, turn_balance, len(s.input_ids))
            if sod_alpha is not None:  # over the turn's action tokens, those TIP left out of the mask too
                gap = (torch.tensor(s.distill.teacher) - torch.tensor(s.old)).abs()
                d = [float(gap[a:b].mean()) if b > a else 0.0 for a, b in spans]
                w = w * spread_turn_values(spans, step_divergence_weights(d, sod_alpha), len(s.input_ids))
        if token_weights is not None:
            w = w * token_weights[i]
        if loss_weights:
            s.distill.weights = (weight * w * mask).tolist()
        else:
            s.advantages = combine_rl_and_distill(torch.tensor(s.advantages), w * a_distill, weight).tolist()
    return gap_sum / max(n, 1)
