"""Training: from rollout trees to updated weights.

The math, plain synchronous torch and pure functions:

- ``logprobs``: runs the model on rows, packed rows and prefix trees;
- ``loss``: PPO-clip, TIS, KL and entropy, from logprobs and advantages, and
  the step's loss (``row_loss``); ``m2po``: M2PO's mask and term;
- ``distill``: on-policy distillation: its config (``distill.config``), its
  teachers (``distill.teachers``), its pure signals (``distill.signals``), their
  application to a batch's samples (``distill.advantages``) and the teacher's
  wiring into the step (``distill.loop``).

The glue:

- ``step``: the learning step, top to bottom (credit, scoring, distillation, update);
- ``batch``: samples, scoring passes, the minibatch step and the optimizer loop;
- ``rows``: how samples are laid into rows: packed episodes or prefix trees;
- ``model``: what trains, the optimizer, precision, the KL reference, weight sync;
- ``trainer``: the run (rollout, the step, sync, eval, checkpoint);
- ``rollouts``: a step's rollouts, the allocator's report, the saved trees (the held-out
  evaluation is ``agentrl.evaluation``, shared with ``agentrl eval``);
- ``token_values``: what the update trained on, per token, saved with the step's trees;
- ``asynchronous``: the next steps' rollouts in a thread, from a snapshot of the
  weights, within a staleness bound (``train.asynchronous``);
- ``sft``: behaviour cloning of an env's expert, with RL's token layout;
- ``plan``: the task seeds of each step, the dry run's plan;
- ``config``, ``checkpoint``, ``metrics``, ``value`` (a value head for GAE), ``cli``.
"""

from .batch import (
    DistillFields,
    Sample,
    SampleScores,
    samples_from_credit,
    score_samples,
    train_on_samples,
)
from .checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from .config import (
    AsyncConfig,
    CheckpointingConfig,
    OptimizerConfig,
    OutputConfig,
    SFTConfig,
    TrainConfig,
    TrainRunConfig,
    load_train_config,
)
from .distill import (
    DistillConfig,
    Distiller,
    OverlapStop,
    add_distill_advantages,
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
from .logprobs import token_logprobs
from .loss import (
    AGGREGATIONS,
    PolicyLossConfig,
    StepLoss,
    TokenMasks,
    aggregate,
    entropy_bonus,
    kl_penalty,
    kl_per_token,
    mean_denominator,
    mismatch_stats,
    policy_loss,
    ppo_clip_loss,
    ppo_clip_token_loss,
    row_loss,
    staleness_mask,
    tis_weights,
    token_masks,
)
from .m2po import m2po_mask, m2po_token_loss, m2po_trust_region
from .rollouts import RolloutSource
from .rows import (
    PackedRow,
    PrefixTree,
    block_causal_mask,
    collate_packed,
    pack_sequences,
    prefix_tree,
    tree_attention_mask,
    tree_token_savings,
)
from .sft import expert_tree, expert_trees
from .step import Learner
from .trainer import Trainer, train

__all__ = [
    "AGGREGATIONS",
    "AsyncConfig",
    "CheckpointingConfig",
    "DistillConfig",
    "DistillFields",
    "Distiller",
    "Learner",
    "OptimizerConfig",
    "OutputConfig",
    "OverlapStop",
    "PackedRow",
    "PolicyLossConfig",
    "PrefixTree",
    "RolloutSource",
    "SFTConfig",
    "Sample",
    "SampleScores",
    "StepLoss",
    "TokenMasks",
    "TrainConfig",
    "TrainRunConfig",
    "Trainer",
    "add_distill_advantages",
    "aggregate",
    "block_causal_mask",
    "collate_packed",
    "combine_rl_and_distill",
    "entropy_bonus",
    "expert_one_hot_teacher",
    "expert_tree",
    "expert_trees",
    "forward_kl",
    "informative_token_mask",
    "jsd",
    "kl_penalty",
    "kl_per_token",
    "latest_checkpoint",
    "linear_schedule",
    "load_checkpoint",
    "load_train_config",
    "local_support_matching",
    "m2po_mask",
    "m2po_token_loss",
    "m2po_trust_region",
    "mean_denominator",
    "mismatch_stats",
    "overlap_stop",
    "pack_sequences",
    "policy_loss",
    "ppo_clip_loss",
    "ppo_clip_token_loss",
    "prefix_tree",
    "prune_checkpoints",
    "reverse_kl_advantage",
    "row_loss",
    "samples_from_credit",
    "save_checkpoint",
    "score_samples",
    "spread_turn_values",
    "staleness_mask",
    "step_divergence_weights",
    "tis_weights",
    "token_logprobs",
    "token_masks",
    "topk_reverse_kl",
    "train",
    "train_on_samples",
    "tree_attention_mask",
    "tree_token_savings",
    "turn_balance_weights",
]
