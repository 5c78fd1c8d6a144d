"""Step-wise on-policy distillation: a teacher scores the student's own turns.

- ``signals``: the pure per-token signals and weights, each a tensor function
  with its paper (GKD's reverse KL, top-k and support-matching divergences,
  TurnOPD, SOD, TIP, the overlap stop, a one-hot expert teacher).
- ``advantages``: those signals laid onto a batch's samples, in place (the
  distillation advantage, a scripted expert's log-probs, the overlap weights).
- ``config``: the ``train.distill`` section (``DistillConfig``) and the weight schedule.
- ``teachers``: loading a teacher, and the privileged and hindsight text it reads.
- ``loop``: the teacher's wiring into the learning step (``Distiller``).

The core update, for a reader: ``advantages.add_distill_advantages`` adds
``w * (log pi_teacher - log pi_student)`` to every action token's advantage
(``signals.reverse_kl_advantage`` and ``signals.combine_rl_and_distill``).
"""

from .advantages import add_distill_advantages, expert_teacher_logprobs, overlap_weights
from .config import DistillConfig, distill_weight
from .loop import Distiller, no_credit
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
from .teachers import (
    document_bos,
    hindsight_summary,
    load_teacher,
    load_vllm_teacher,
    privileged_prefix,
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
    "document_bos",
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
    "overlap_weights",
    "privileged_prefix",
    "reverse_kl_advantage",
    "spread_turn_values",
    "step_divergence_weights",
    "topk_reverse_kl",
    "turn_balance_weights",
]
