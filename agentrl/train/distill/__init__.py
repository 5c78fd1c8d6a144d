"""Step-wise on-policy distillation: a teacher scores the student's own turns.

- ``signals``: the pure per-token signals and weights, each a tensor function
  with its paper (GKD's reverse KL, top-k and support-matching divergences,
  TurnOPD, SOD, TIP, the overlap stop, a one-hot expert teacher).
- ``loop``: their wiring into a rollout batch: the config (``DistillConfig``),
  the teacher (``Distiller``), privileged and hindsight context.

The core update, for a reader: ``loop.add_distill_advantages`` adds
``w * (log pi_teacher - log pi_student)`` to every action token's advantage
(``signals.reverse_kl_advantage`` and ``signals.combine_rl_and_distill``).
"""

from .loop import (
    DistillConfig,
    Distiller,
    add_distill_advantages,
    distill_weight,
    expert_teacher_logprobs,
    hindsight_summary,
    load_teacher,
    load_vllm_teacher,
    no_credit,
    privileged_prefix,
)
from .signals import (
    OverlapStop,
    build_support,
    combine_rl_and_distill,
    depth_budget,
    distribution_loss,
    expert_one_hot_teacher,
    forward_kl,
    informative_token_mask,
    jsd,
    linear_schedule,
    local_support_matching,
    overlap_stop,
    reverse_kl_advantage,
    spread_turn_values,
    step_divergence_weights,
    topk_reverse_kl,
    turn_balance_weights,
)

__all__ = [
    "DistillConfig",
    "Distiller",
    "OverlapStop",
    "add_distill_advantages",
    "build_support",
    "combine_rl_and_distill",
    "depth_budget",
    "distill_weight",
    "distribution_loss",
    "expert_one_hot_teacher",
    "expert_teacher_logprobs",
    "forward_kl",
    "hindsight_summary",
    "informative_token_mask",
    "jsd",
    "linear_schedule",
    "load_teacher",
    "load_vllm_teacher",
    "local_support_matching",
    "no_credit",
    "overlap_stop",
    "privileged_prefix",
    "reverse_kl_advantage",
    "spread_turn_values",
    "step_divergence_weights",
    "topk_reverse_kl",
    "turn_balance_weights",
]
