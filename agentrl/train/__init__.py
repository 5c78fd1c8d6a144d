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

from ..lazy_exports import lazy_exports

# each module's names are imported on first use (agentrl.lazy_exports): the CLI imports
# this package, and most commands need no torch
__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".batch": ["DistillFields", "Sample", "SampleScores", "samples_from_credit", "score_samples",
        "train_on_samples"],
    ".checkpoint": ["latest_checkpoint", "load_checkpoint", "prune_checkpoints", "save_checkpoint"],
    ".config": ["AsyncConfig", "CheckpointingConfig", "OptimizerConfig", "OutputConfig", "SFTConfig",
        "TrainConfig", "TrainRunConfig", "load_train_config"],
    ".distill": ["DistillConfig", "Distiller", "OverlapStop", "add_distill_advantages",
        "combine_rl_and_distill", "expert_one_hot_teacher", "forward_kl", "informative_token_mask", "jsd",
        "linear_schedule", "local_support_matching", "overlap_stop", "reverse_kl_advantage",
        "spread_turn_values", "step_divergence_weights", "topk_reverse_kl", "turn_balance_weights"],
    ".logprobs": ["token_logprobs"],
    ".loss": ["AGGREGATIONS", "PolicyLossConfig", "StepLoss", "TokenMasks", "aggregate", "entropy_bonus",
        "kl_penalty", "kl_per_token", "mean_denominator", "mismatch_stats", "policy_loss", "ppo_clip_loss",
        "ppo_clip_token_loss", "row_loss", "staleness_mask", "tis_weights", "token_masks"],
    ".m2po": ["m2po_mask", "m2po_token_loss", "m2po_trust_region"],
    ".rollouts": ["RolloutSource"],
    ".rows": ["PackedRow", "PrefixTree", "block_causal_mask", "collate_packed", "pack_sequences",
        "prefix_tree", "tree_attention_mask", "tree_token_savings"],
    ".sft": ["expert_tree", "expert_trees"],
    ".step": ["Learner"],
    ".trainer": ["Trainer", "train"],
})
