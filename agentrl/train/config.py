"""Training configuration: the pydantic models of ``agentrl train`` and ``agentrl sft``.

``TrainConfig`` (the ``train:`` section) says how to learn from rollouts:
which credit assignment, which loss and off-policy corrections, how the
optimizer steps, what is trainable, when to evaluate and checkpoint.
``SFTConfig`` (the ``sft:`` section) says how to learn from an env's expert.
``TrainRunConfig`` is the run ``Config`` (policy, sampling, env, rollout) plus
those two sections; ``load_train_config`` reads it from YAML and ``--set``
overrides, and names the key path of any bad value.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ..config import (
    MAX_TASKS,
    Config,
    Seed,
    _Strict,
    check_task_seeds,
    expand_path,
    folded_options,
    load_config,
    moved_keys,
)
from ..credit_options import CreditOptions, GRPOOptions, credit_spec
from ..evaluation import EvaluationConfig
from .curriculum import CurriculumStage, SFTLevel
from .distill.config import DistillConfig
from .loss import PolicyLossConfig
from .value import ValueHeadConfig

__all__ = [
    "AsyncConfig",
    "CheckpointingConfig",
    "EvaluationConfig",
    "LoraConfig",
    "OptimizerConfig",
    "OutputConfig",
    "SFTConfig",
    "TrainConfig",
    "TrainRunConfig",
    "load_train_config",
]

MOVED_KEYS = {
    "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "betas": "optimizer.betas",
    "warmup_steps": "optimizer.warmup_steps", "lr_schedule": "optimizer.lr_schedule",
    "max_grad_norm": "optimizer.max_grad_norm",
    "eval_every": "evaluation.every", "eval_episodes": "evaluation.episodes",
    "eval_start": "evaluation.start", "eval_seed_start": "evaluation.seed_start",
    "eval_task_seeds": "evaluation.task_seeds", "eval_temperature": "evaluation.temperature",
    "eval_env_kwargs": "evaluation.env_kwargs",
    "checkpoint_every": "checkpointing.every", "keep_checkpoints": "checkpointing.keep",
    "export_hf": "checkpointing.export_hf",
    "out_dir": "output.dir", "tensorboard": "output.tensorboard", "plot": "output.plot",
    "save_trees": "output.save_trees",
}
"""The flat ``train`` keys that moved into a section, old key to new path: they keep working
for one release, with a ``FutureWarning`` naming the new path."""


def fold_credit_options(data: Any) -> Any:
    """``data`` (a ``train`` mapping) with the old ``credit: NAME`` beside ``credit_options:
    {...}`` as ``credit: {name: NAME, ...}``, with a ``FutureWarning``, for one release."""
    return folded_options(data, "train", "credit", "grpo")


class LoraConfig(_Strict):
    """Low-rank adapters (Hu et al. 2021) through ``peft``, for ``trainable: lora``."""

    r: int = Field(16, ge=1, description="Rank of each adapter.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is alpha / r * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear layers that get adapters.")


class OptimizerConfig(_Strict):
    """AdamW and its learning-rate schedule (``train.optimizer``); SFT uses them too, with ``sft.lr``."""

    lr: float = Field(1e-5, ge=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up. In RL, counted as "
                              "planned: epochs * ceil(tasks_per_step * group_size / minibatch_size) a step, "
                              "which a step with more or fewer minibatches shares out among its own.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Decay after warm-up, to 0 at the last optimizer step (in RL, at the end "
        "of the last step, whatever the steps' minibatch counts).")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Gradient clipping; null: none.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        """What torch's AdamW takes, checked when the config loads: AdamW refuses others only
        when it is built, after the model has loaded, naming no key."""
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


class CheckpointingConfig(_Strict):
    """When checkpoints are written and how many stay (``train.checkpointing``)."""

    every: int = Field(0, ge=0, description="Checkpoint every this many steps (0: only at the end). "
                       "Was checkpoint_every.")
    keep: int = Field(2, ge=1, description="Newest checkpoints kept on disk. Was keep_checkpoints.")
    export_hf: bool = Field(True, description="Also export the final model with save_pretrained.")


class OutputConfig(_Strict):
    """Where a run writes, and what besides its checkpoints (``train.output``)."""

    dir: str = Field("runs/train", min_length=1,  # "" is the working directory, where --overwrite removes folders
                     description="Metrics, checkpoints and the learning curve (~ and $NAME "
                     "expand as in a shell). Was out_dir.")
    tensorboard: bool = Field(True, description="Also write TensorBoard logs, when installed.")
    plot: bool = Field(True, description="Draw learning_curve.png (matplotlib) at the end.")
    save_trees: int = Field(8, ge=0, description="Trees of each step's rollouts written to "
                            "output.dir/trees/step-NNNNNN.jsonl (the first this many tasks), for "
                            "`agentrl tree` and `agentrl view`; 0: none.")

    _dir = field_validator("dir")(expand_path)


class AsyncConfig(_Strict):
    """Asynchronous training (``agentrl.train.asynchronous``): the next steps roll out from a
    copy of the weights (in this process, or the rollout workers') while this step trains."""

    max_batch_staleness: int = Field(
        1, ge=0, description="k: a step's whole batch is trained only while its oldest token is at "
        "most k policy versions behind the trainer (an older batch is dropped and replaced); the "
        "rollouts run at most k steps ahead. 0 rolls out each step after the previous sync, "
        "overlapping only eval and checkpoints: the synchronous run, bit for bit with "
        "rollout.deterministic: true. (Single tokens: loss.max_token_staleness.) Was max_staleness.")
    queue_size: int = Field(2, ge=1, description="Finished step batches waiting for the trainer; "
                            "the rollouts wait while it is full.")
    batch_timeout_s: float | None = Field(7200.0, gt=0, description="Longest the trainer waits for "
                                          "the next step's batch before the run fails, naming what the "
                                          "rollouts were doing (a hung generate, say); null: no limit.")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return moved_keys(data, {"max_staleness": "max_batch_staleness"}, "train.asynchronous")


class TrainConfig(_Strict):
    """The RL loop: rollouts, credit, loss, optimizer step, weight sync, eval, checkpoint."""

    # -- data ----------------------------------------------------------------------
    steps: int = Field(20, ge=0, description="Updates (rollout batches) to run in all; 0 without "
                       "SFT is a dry run: the config is checked, the model loaded, the plan printed.")
    tasks_per_step: int = Field(4, ge=1, le=MAX_TASKS, description="Task seeds per rollout batch; each "
                                "gets rollout.group_size episodes (its group).")
    task_seed_start: Seed = Field(0, description="Step k trains on task seeds "
                                 "start + k * tasks_per_step, ... (the data position).")
    task_seeds: list[Seed] | None = Field(
        None, description="A fixed pool of training task seeds, cycled in order; "
        "overrides task_seed_start (e.g. seeds of one task family).")
    curriculum: list[CurriculumStage] = Field(
        default_factory=list, description="Env levels by RL step, in order: [{name, env_kwargs, "
        "max_turns, steps}, ...]; each stage's env_kwargs are merged over env.kwargs for its steps, "
        "and the last stage may omit steps (agentrl.train.curriculum). Empty: env.kwargs throughout.")
    seed: Seed = Field(0, description="Seeds sampling streams, minibatch order and torch init.")
    # -- credit --------------------------------------------------------------------
    credit: CreditOptions = Field(
        default_factory=GRPOOptions, description="Credit assignment method (agentrl.credit.ESTIMATORS) "
        "and its options: {name: gigpo, gamma: 0.95, omega: 1.0}; a plain name takes the defaults; "
        "none: no RL advantage (distillation only, needs distill).")
    value_head: ValueHeadConfig | None = Field(None, description="credit: gae: a turn-level value "
                                               "head V(s) for GAE (agentrl.train.value); null: V = 0.")
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig,
                                   description="PPO-clip, TIS, staleness, M2PO, KL and entropy "
                                   "(agentrl.train.loss.PolicyLossConfig).")
    skip_zero_advantage: bool = Field(True, description="Leave out episodes whose advantages are "
                                      "all zero (a group with equal rewards): no policy gradient, "
                                      "so their forward and backward are saved. Kept when the KL "
                                      "or entropy term is on.")
    tree_packing: bool = Field(False, description="Run each minibatch's episodes as prefix trees "
                               "(agentrl.train.rows): tokens shared by a tree's episodes go "
                               "through the model once. Needs loss.agg=token-mean, no KL or entropy term, "
                               "no M2PO.")
    distill: DistillConfig | None = Field(None, description="Step-wise on-policy distillation "
                                          "(agentrl.train.distill): a teacher's per-token advantages "
                                          "added to the RL ones; null: off.")
    # -- the update ------------------------------------------------------------------
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    minibatch_size: int = Field(16, ge=1, description="Episodes per optimizer step.")
    old_logprobs: Literal["rescore", "sampler", "auto"] = Field(
        "rescore", description="PPO's anchor where a batch makes several optimizer steps (more "
        "episodes than minibatch_size, or epochs > 1): rescore = a no-grad pass of the trainer "
        "before the update, over every minibatch but the update's first, which anchors to its own "
        "forward (the same numbers; with train.distill or dropout the pass covers all; train/scored_samples "
        "logs how many it scored); sampler = the log-probs the sampler returned with each token, no pass "
        "(the same numbers where the sampler computes what the trainer does, as the hf backend in "
        "fp32 does to about 1e-5; elsewhere the ratio would also carry the sampler-trainer mismatch, "
        "which TIS then cannot see). Refused with top_p or top_k truncation, a backend other than hf, "
        "policy.dtype other than float32, a train.precision or policy.precision that resolves to bf16, "
        "train.asynchronous and train.distill. auto = sampler where none of these applies on this machine, else rescore "
        "(the run prints which).")
    micro_batch_tokens: int = Field(4096, ge=16, description="Tokens per forward pass: episodes "
                                    "are packed up to this; a minibatch accumulates gradients "
                                    "over its micro-batches.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="The training and scoring passes: auto is bf16 autocast on a GPU with native bf16 (Ampere on; a T4 or V100 gets fp32) and on "
        "a CPU with avx512_bf16 or AMX (on a Xeon with AMX the make run recipe's SFT at 1.6x fp32's "
        "tokens/s, learning as well), fp32 on other CPUs, where bf16 is emulated and many times slower "
        "(AGENTRL_CPU_BF16=1/0 overrides the detection); bf16 autocasts anywhere; fp32 never does. "
        "The vocabulary head, weights and optimizer state stay fp32; the hf sampler follows it "
        "(policy.precision auto).")
    compile: Literal["auto"] | bool = Field(
        False, description="Run the decoder layers through torch.compile in the training and scoring "
        "passes (agentrl.train.compiled; sampling stays eager): true anywhere; auto where those passes "
        "run in bf16 on a CPU that builds the kernels; false never. On 2 AMX cores the bf16 update ran 1.5x "
        "faster compiled (538 against 358 tokens/s), make run's SFT 1.14x and the GRPO make run's training 15.9 against 17.0 min "
        "(warm compile cache, which the agentrl command keeps in ~/.cache/agentrl/inductor; cold, about 1 min "
        "more); it learned as well: RL over 9 paired seeds (+0.005 +- 0.025), SFT over 6 (+0.026 +- 0.045; "
        "docs/benchmark-notes.md). make run's recipe sets auto. Off by default: each new kind of pass "
        "compiles first, about 10 s, once a process.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig,
                                       description="AdamW, its schedule and gradient clipping.")
    # -- what trains -----------------------------------------------------------------
    trainable: Literal["full", "top_k", "lora"] = Field(
        "full", description="full fine-tuning, only the top k decoder layers, or LoRA adapters.")
    top_k_layers: int = Field(4, ge=1, description="For trainable=top_k: how many top layers.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="For trainable=lora.")
    # -- harness -------------------------------------------------------------------------
    harness: str | None = Field(None, description="Train an agent program instead of the native "
                                "engine: the command that plays one episode through the proxy "
                                "and the env server (agentrl.proxy.rollouts); null: native rollouts.")
    harness_env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for the harness command. It gets "
        "the trainer's environment less its credentials (names with a word such as TOKEN, SECRET, "
        "PASSWORD, KEY or AUTH), so pass any it needs here. Values are text: in YAML quote one that "
        "would read as a number or a bool ('0123', 'yes', 'on', '1.0'); --set keeps it as written.")
    harness_cwd: str | None = Field(
        None, description="Where every episode's harness runs (shared by them, and kept); ~ and "
        "$NAME expand. null: each episode in a new empty folder of its own, removed when it ends, "
        "with relative file paths in the command made absolute (agentrl.proxy.harness).")
    _harness_cwd = field_validator("harness_cwd")(lambda v: None if v is None else expand_path(v))
    harness_submit: Literal["stdout"] | None = Field(
        None, description="stdout: once the harness exits, its standard output (all of it, up to "
        "1,000,000 characters, stripped) is the env's next action, the episode's answer, for agent programs "
        "that never call the env server (a CLI such as claude -p or codex exec); null: the harness "
        "steps the env itself.")
    asynchronous: AsyncConfig | None = Field(None, description="Roll out the next steps while "
                                             "this one trains, within a staleness bound "
                                             "(agentrl.train.asynchronous); null: synchronous.")
    # -- eval, checkpoints, output -----------------------------------------------------------
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig, description="Held-out "
                                         "evaluation: seeds, how often, temperature (agentrl.evaluation).")
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig,
                                               description="How often checkpoints are written, how many kept.")
    output: OutputConfig = Field(default_factory=OutputConfig, description="The run's folder, and "
                                 "its logs, plot and saved trees.")

    @model_validator(mode="before")
    @classmethod
    def _old_places(cls, data: Any) -> Any:
        return moved_keys(data, MOVED_KEYS, "train")

    @model_validator(mode="before")
    @classmethod
    def _fold_credit_options(cls, data: Any) -> Any:
        return fold_credit_options(data)

    @field_validator("harness_env")
    @classmethod
    def _environment_variables(cls, value: dict[str, str]) -> dict[str, str]:
        """Names and values the operating system takes, checked when the config loads: the
        harness's start refused them (ValueError) in every episode, each then failing."""
        for name, text in value.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"{name!r} is no environment variable name: give a non-empty name without '='")
            if "\0" in text:
                raise ValueError(f"{name}: a value cannot hold a NUL character")
        return value

    @field_validator("credit", mode="before")
    @classmethod
    def _credit_by_name(cls, value: Any) -> Any:
        """A plain name is that method with its default options; a bad name fails here,
        with the closest valid one, before any model loads."""
        return credit_spec(value)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.task_seeds is not None and not self.task_seeds:
            raise ValueError("task_seeds: give at least one seed, or null")
        for i, stage in enumerate(self.curriculum[:-1]):
            if stage.steps is None:
                raise ValueError(f"curriculum.{i}.steps: only the last stage may leave steps out "
                                 "(it runs to the end); the stages after it would never run")
        before_last = sum(s.steps or 0 for s in self.curriculum[:-1])
        if self.curriculum and self.steps and before_last >= self.steps:
            raise ValueError(f"curriculum: the stages before the last take {before_last} steps, but "
                             f"train.steps={self.steps}; the last stage would never run")
        if self.harness is not None and not self.harness.strip():
            raise ValueError("harness: give the command that runs one episode, or null")
        if self.value_head is not None and self.credit.name != "gae":
            raise ValueError(f"value_head is read by credit: 'gae' only, not {self.credit.name!r}")
        if self.credit.name == "none" and self.distill is None:
            raise ValueError("credit: 'none' leaves nothing to learn from; set distill, or a "
                             "credit method")
        if self.tree_packing:  # a shared token carries its episodes' advantages summed (rows.py)
            if self.loss.agg != "token-mean":
                raise ValueError(f"tree_packing needs loss.agg='token-mean', got {self.loss.agg!r}: "
                                 "a shared token cannot be split between per-episode means")
            if self.loss.kl_coef > 0 or self.loss.entropy_coef > 0:
                raise ValueError("tree_packing needs loss.kl_coef=0 and loss.entropy_coef=0: those "
                                 "terms would count each shared token once instead of once per episode")
            if self.loss.m2po_tau is not None:
                raise ValueError("tree_packing needs loss.m2po_tau=null: M2PO's mask drops single episode "
                                 "tokens, which a token shared by several episodes cannot follow")
            d = self.distill
            if d is not None and (d.signal != "reverse_kl" or d.overlap_threshold is not None):
                raise ValueError("tree_packing does not carry top-k distributions yet: use "
                                 "distill.signal='reverse_kl' without overlap_threshold, or tree_packing=false")
        if self.harness is not None and self.distill is not None and (
                self.distill.privileged or self.distill.teacher in ("expert", "oracle")):
            raise ValueError("harness runs episodes through the env server, which keeps the privileged "
                             "text and expert actions from agents: distill.privileged and "
                             "distill.teacher='expert' or 'oracle' need the native engine (no harness)")
        if self.asynchronous is not None and self.harness is not None:
            raise ValueError("asynchronous needs native rollouts: a harness samples through the proxy "
                             "from the trained model itself, not from a snapshot; set harness=null or "
                             "asynchronous=null")
        return self


class SFTConfig(_Strict):
    """Supervised fine-tuning on an env's expert trajectories (``expert_action()``)."""

    episodes: int = Field(0, ge=0, le=MAX_TASKS, description="Expert episodes; 0 skips SFT in `agentrl train`.")
    seed_start: Seed = Field(0, description="Expert episodes use task seeds seed_start, +1, ...")
    task_seeds: list[Seed] | None = Field(None, description="Explicit expert task seeds; "
                                         "overrides seed_start and episodes.")
    levels: list[SFTLevel] = Field(
        default_factory=list, description="Expert episodes at several env levels, one dataset: "
        "[{name, env_kwargs, max_turns, episodes}, ...] on consecutive seeds from seed_start "
        "(agentrl.train.curriculum); in place of episodes and task_seeds. Empty: env.kwargs.")
    epochs: int = Field(2, ge=1, description="Passes over the expert data.")
    lr: float = Field(1e-4, ge=0.0, description="AdamW learning rate.")
    minibatch_size: int = Field(8, ge=1, description="Episodes per optimizer step.")
    max_turns: int | None = Field(None, ge=1, description="Expert turns per episode; "
                                  "null: rollout.max_turns.")
    nll_episodes: int = Field(32, ge=0, description="How many expert episodes (evenly spaced over "
                              "the levels) the "
                              "sft/nll_before and sft/nll_after diagnostics score; each score is a "
                              "forward pass over them (on all 128 of the ALFWorld recipe: 55 s of "
                              "a 15-minute run); 0 skips both.")
    constrain: bool | None = Field(
        False, description="Score each expert turn under rollout.constrain's admissible-action "
        "constraint, as the policy samples it: the loss is then the NLL of choosing the expert's "
        "action among the actions the env listed (agentrl.policy.constrain), and tokens with one "
        "allowed id carry none. false (default): the whole vocabulary, which learned better: on "
        "make run's level, evaluated under the constraint over 3 replicates, 0.755 +- 0.036 against "
        "0.583 +- 0.094 constrained; true needs rollout.constrain=admissible; null follows it.")
    expert: Literal["observable", "oracle"] = Field(
        "observable", description="Which scripted expert to clone: observable, the env's "
        "expert_action(), which acts only on what the agent has seen; oracle, its "
        "oracle_action(), which reads hidden state (a policy of the observations cannot "
        "follow it, so cloning it teaches behaviour the student cannot reproduce).")

    _task_seeds = field_validator("task_seeds")(check_task_seeds)

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        if self.levels and (self.episodes or self.task_seeds):
            raise ValueError("levels gives the expert episodes per level: leave sft.episodes (0) and "
                             "sft.task_seeds (null) out beside it")
        return self

    @property
    def enabled(self) -> bool:
        """Whether there are expert episodes to learn from."""
        return bool(self.episodes or self.task_seeds or self.levels)


class TrainRunConfig(Config):
    """A run config with a ``train`` and an ``sft`` section.

    Every check the config alone decides is a validator, so a bad config fails
    when it loads, before any model does, and names its key.
    """

    old_paths: ClassVar[dict[str, str]] = {
        **{f"train.{old}": f"train.{new}" for old, new in MOVED_KEYS.items()},
        "train.loss.max_staleness": "train.loss.max_token_staleness",
        "train.asynchronous.max_staleness": "train.asynchronous.max_batch_staleness",
    }

    train: TrainConfig = Field(default_factory=TrainConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)

    @classmethod
    def upgrade_old_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Also the old ``train.credit_options``, folded into ``train.credit`` before ``--set``
        applies, so that ``--set train.credit.gamma=0.5`` sets the file's option."""
        train = data.get("train")
        if isinstance(train, dict):
            try:
                data = {**data, "train": fold_credit_options(train)}
            except ValueError:
                pass  # both forms given: the validator names them
        return super().upgrade_old_keys(data)

    @classmethod
    def upgrade_old_override(cls, key: str, data: dict[str, Any]) -> str:
        """``train.credit_options.K`` as ``train.credit.K`` where ``train.credit`` is already a
        mapping (a recipe's ``{name: ..., ...}``, which the old form cannot sit beside); else
        the validator folds it, with whatever ``train.credit`` ends up naming."""
        credit = (data.get("train") or {}).get("credit") if isinstance(data.get("train"), dict) else None
        if not key.startswith("train.credit_options.") or not isinstance(credit, dict):
            return key
        warnings.warn("train.credit_options is deprecated and will be removed in the next release: "
                      f"use train.credit: {{name: {credit.get('name')}, <option>: <value>}}",
                      FutureWarning, stacklevel=4)
        return "train.credit." + key.removeprefix("train.credit_options.")

    def sampler_anchor_refusal(self) -> str | None:
        """Why ``train.old_logprobs: sampler`` would anchor PPO to other numbers than the
        trainer's, as far as the config tells (the trainer checks the resolved backend and
        precision); None where it would not."""
        sp, t = self.sampling, self.train
        if sp.top_p < 1.0 or sp.top_k > 0:
            return (f"sampling.top_p={sp.top_p}, sampling.top_k={sp.top_k}: the sampler's log-probs are of "
                    "the truncated distribution, the trainer's of the whole one")
        if self.policy.backend not in ("hf", "auto") or self.policy.dtype != "float32":
            return (f"policy.backend={self.policy.backend!r}, policy.dtype={self.policy.dtype!r}: the "
                    "sampler must compute what the trainer does, the hf backend in float32")
        if t.precision == "bf16":
            return "train.precision=bf16: the update scores in bf16, and only fp32 numbers match to 1e-5"
        if self.policy.precision == "bf16":
            return ("policy.precision=bf16: the sampler computes in bf16, and only an fp32 sampler gives the "
                    "fp32 update's log-probs")
        workers = self.distributed is not None and self.distributed.num_rollout_workers > 0
        if workers and self.policy.backend == "auto":
            return ("distributed.num_rollout_workers with policy.backend=auto: each worker resolves the "
                    "backend on its own node (vllm where installed), which the trainer cannot check; "
                    "set policy.backend: hf")
        if t.asynchronous is not None:
            return ("train.asynchronous: tokens sampled by older weights would anchor PPO to those "
                    "weights, not to the ones the update starts from")
        if t.distill is not None:
            return "train.distill: the teacher's signal and its labels read the trainer's own scores"
        return None

    @model_validator(mode="after")
    def _check_sections(self) -> TrainRunConfig:
        if self.train.micro_batch_tokens < self.rollout.max_context_tokens:
            raise ValueError(f"train.micro_batch_tokens={self.train.micro_batch_tokens} is below "
                             f"rollout.max_context_tokens={self.rollout.max_context_tokens}: an episode "
                             "must fit one forward pass")
        caps = {st.max_turns for st in self.train.curriculum if st.max_turns is not None}
        if self.train.harness is not None and caps:
            raise ValueError("train.curriculum: a harness plays its episodes to the end, so a stage's "
                             "max_turns cannot cap them; leave max_turns out of the stages")
        d = self.train.distill
        if d is not None and d.depth_coverage is not None and caps - {self.rollout.max_turns}:
            raise ValueError("train.curriculum: stages with their own max_turns and distill.depth_coverage "
                             "(TurnOPD's depth budget) do not mix: the budget never exceeds the deepest turn "
                             "already played, so a stage with more turns would never get them")
        if self.train.harness is not None and self.rollout.allocator.name != "independent":
            raise ValueError(f"train.harness: a harness plays whole episodes, so rollout.allocator must "
                             f"be 'independent' (got {self.rollout.allocator.name!r})")
        if d is not None and d.teacher.startswith("vllm:") and self.rollout.constrain == "admissible":
            raise ValueError("train.distill.teacher='vllm:...' scores each token over the whole vocabulary "
                             "(prompt logprobs), while rollout.constrain=admissible samples it among the "
                             "admissible actions; the teacher must score under the same constraint: use a "
                             "model folder or name as the teacher (scored in this process, under the mask)")
        if self.sft.constrain and self.rollout.constrain != "admissible":
            raise ValueError("sft.constrain=true scores the expert's turns under the admissible-action "
                             "constraint, which needs rollout.constrain=admissible "
                             f"(got {self.rollout.constrain!r})")
        if self.train.old_logprobs == "sampler" and (why := self.sampler_anchor_refusal()) is not None:
            raise ValueError(f"train.old_logprobs=sampler is refused with {why}; use rescore")
        dist = self.distributed
        workers = dist is not None and dist.num_rollout_workers > 0
        if self.train.asynchronous is not None and not workers and self.policy.backend not in ("hf", "auto"):
            raise ValueError(f"train.asynchronous samples from a copy of the weights, which only "
                             f"policy.backend='hf' keeps in this process (got {self.policy.backend!r}); "
                             "rollout workers (distributed.num_rollout_workers) hold their own copy")
        return self


def load_train_config(path: str | Path | None = None,
                      overrides: list[str] | None = None) -> TrainRunConfig:
    """``load_config`` with the ``train`` and ``sft`` sections. Raises ``ConfigError``."""
    return load_config(path, overrides, TrainRunConfig)
