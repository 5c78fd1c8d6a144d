"""Training math: per-token logprobs of the policy, the policy losses, and on-policy distillation signals.

``logprobs`` runs the model (rows, packed rows, prefix trees); ``loss`` turns
logprobs and advantages into a scalar; ``distill`` turns teacher scores into
per-token advantages and weights. All plain synchronous torch.
"""

from .distill import (
    OverlapStop,
    combine_rl_and_distill,
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
from .logprobs import (
    PackedRow,
    PrefixTree,
    block_causal_mask,
    collate_packed,
    pack_sequences,
    prefix_tree,
    token_logprobs,
    tree_attention_mask,
    tree_token_savings,
)
from .loss import (
    AGGREGATIONS,
    PolicyLossConfig,
    aggregate,
    entropy_bonus,
    kl_penalty,
    kl_per_token,
    m2po_mask,
    mismatch_stats,
    policy_loss,
    ppo_clip_loss,
    ppo_clip_token_loss,
    staleness_mask,
    tis_weights,
)

__all__ = [
    "AGGREGATIONS",
    "OverlapStop",
    "PackedRow",
    "PolicyLossConfig",
    "PrefixTree",
    "aggregate",
    "block_causal_mask",
    "collate_packed",
    "combine_rl_and_distill",
    "entropy_bonus",
    "expert_one_hot_teacher",
    "forward_kl",
    "informative_token_mask",
    "jsd",
    "kl_penalty",
    "kl_per_token",
    "linear_schedule",
    "local_support_matching",
    "m2po_mask",
    "mismatch_stats",
    "overlap_stop",
    "pack_sequences",
    "policy_loss",
    "ppo_clip_loss",
    "ppo_clip_token_loss",
    "prefix_tree",
    "reverse_kl_advantage",
    "spread_turn_values",
    "staleness_mask",
    "step_divergence_weights",
    "tis_weights",
    "token_logprobs",
    "topk_reverse_kl",
    "tree_attention_mask",
    "tree_token_savings",
    "turn_balance_weights",
]

# The loop, its config and checkpoints (trainer.py, config.py, checkpoint.py, sft.py).
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from .config import SFTConfig, TrainConfig, TrainRunConfig, load_train_config  # noqa: E402
from .harness import HarnessRollouts, merge_sessions  # noqa: E402
from .opd import DistillConfig, Distiller, add_distill_advantages  # noqa: E402
from .sft import expert_tree, expert_trees  # noqa: E402
from .trainer import Trainer, evaluate, train  # noqa: E402
from .tree_pack import score_samples_tree, tree_minibatch  # noqa: E402

__all__ += [
    "DistillConfig",
    "Distiller",
    "HarnessRollouts",
    "SFTConfig",
    "TrainConfig",
    "TrainRunConfig",
    "Trainer",
    "evaluate",
    "expert_tree",
    "expert_trees",
    "latest_checkpoint",
    "load_checkpoint",
    "load_train_config",
    "add_distill_advantages",
    "merge_sessions",
    "save_checkpoint",
    "score_samples_tree",
    "train",
    "tree_minibatch",
]
