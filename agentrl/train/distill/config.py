"""The ``train.distill`` config section, and the distillation weight of a step.

One job: say who teaches, with which signal, how strongly, and refuse a
combination that would do nothing or the wrong thing (each error names its
key). ``distill_weight`` reads the weight schedule. The teacher itself is
loaded in ``teachers``; its signal is wired into a batch by ``loop``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ...config import expand_path
from ...strict import StrictModel
from .signals import linear_schedule

__all__ = ["DistillConfig", "distill_weight"]


class DistillConfig(StrictModel):
    """The ``train.distill`` section: who teaches, with which signal, how strongly."""

    teacher: str = Field(description="A registered model name or a local transformers folder "
                         "(e.g. an SFT checkpoint's hf/), loaded frozen; same tokenizer as the student. "
                         "'vllm:NAME': the same, served by an in-process vLLM engine (prompt logprobs; "
                         "sampled-token reverse KL only). "
                         "'self': the student's current weights (needs privileged: true). "
                         "'expert': the env's scripted expert (env.expert_action(), which acts on "
                         "what was observed) as a one-hot teacher: with signal reverse_kl on the "
                         "student's sampled tokens; with forward_kl its whole action labels the turns "
                         "where the student left it (DAgger). "
                         "'oracle': the same with the env's privileged oracle (env.oracle_action(), "
                         "which reads hidden state).")

    @field_validator("teacher")
    @classmethod
    def _teacher_path(cls, value: str) -> str:
        """A teacher given as a local folder (``~/runs/sft/hf``, ``vllm:$MODELS/big``) expands ``~``
        and ``$NAME`` as ``policy.model`` does; it was looked up as written, a folder named '~'."""
        prefix = "vllm:" if value.startswith("vllm:") else ""
        return prefix + expand_path(value.removeprefix(prefix))  # an unset variable: its ValueError
    turn_balance: bool = Field(False, description="TurnOPD: move the distillation weights from "
                               "token-balanced (step 0) to turn-balanced (last step), so every turn "
                               "counts the same however many tokens it took.")
    depth_coverage: float | None = Field(None, gt=0.0, le=1.0, description="TurnOPD's depth budget: "
                                         "each step's rollout.max_turns becomes the fewest turns that hold "
                                         "this share of the per-turn teacher-student divergence (summed "
                                         "over the batch, exponentially averaged over steps); null: off.")
    depth_min_turns: int = Field(1, ge=1, description="The depth budget never goes below this.")
    sod_alpha: float | None = Field(None, ge=0.0, description="SOD: scale each turn's distillation "
                                    "signal by exp(-alpha * d), d its mean |log p_s - log p_t|; null: off.")
    tip: bool = Field(False, description="TIP: train only on informative action tokens (high student "
                      "entropy, or low entropy with a large teacher-student gap); the rest leave the loss, "
                      "RL term included.")
    expert_floor: float = Field(-20.0, lt=0.0, description="teacher: expert: the log-prob standing "
                                "for 0 on tokens that leave the expert's action. Keep it below the "
                                "student's own log-probs (about -10.8 for a uniform 49k vocabulary), or "
                                "a mismatching token gets a positive advantage.")
    privileged: bool = Field(False, description="Give the teacher privileged text as a system message "
                             "before the student's tokens (privileged_source says which).")
    privileged_source: Literal["env", "hindsight"] = Field(
        "env", description="env: the env's reset info['privileged'] (a hidden goal, an expert plan). "
        "hindsight: a summary of the group's rollouts of the same task (the actions of its best "
        "episode and their return), written after the group has run.")
    signal: Literal["reverse_kl", "topk_reverse_kl", "lsm", "forward_kl", "jsd"] = Field(
        "reverse_kl", description="Per-token signal. reverse_kl: the sampled-token advantage "
        "log pi_teacher - log pi_student. On top_k candidate ids a token (a loss term): topk_reverse_kl "
        "(truncated sum over the student's top-K), lsm (local support matching: both renormalised on "
        "it), forward_kl and jsd (over the student's and the teacher's top-K).")
    top_k: int = Field(16, ge=1, le=64, description="Candidate ids per model and action token for the "
                       "distribution-level signals and the overlap stop (each sample holds them per token "
                       "as lists, so keep it small).")
    mask_special: bool = Field(True, description="Leave special tokens (end of turn, tool tags) out "
                               "of the distribution-level support.")
    jsd_beta: float = Field(0.5, gt=0.0, lt=1.0, description="signal: jsd: the teacher's share of the mixture.")
    overlap_threshold: float | None = Field(None, ge=0.0, le=1.0, description="Prune-OPD/ESR: once the "
                                            "teacher-student top-k overlap at an action token falls "
                                            "below this, down-weight the rest of the episode's signal; "
                                            "null: off.")
    overlap_after_weight: float = Field(0.0, ge=0.0, le=1.0, description="The weight of the "
                                        "distillation signal after the overlap stop.")
    expert_label_turns: int = Field(1, ge=1, description="teacher: expert or oracle with signal: forward_kl "
                                    "(DAgger): how many of each episode's turns where the student left "
                                    "the expert, earliest first, get the expert's action as a label.")
    weight: float = Field(1.0, ge=0.0, description="Distillation weight w at step 0.")
    weight_end: float | None = Field(None, ge=0.0, description="w at the end of the schedule "
                                     "(linear from weight); null: constant.")
    weight_steps: int | None = Field(None, ge=1, description="Steps over which w moves to "
                                     "weight_end; null: train.steps.")
    teacher_temperature: float = Field(1.0, gt=0.0, description="Temperature the teacher's "
                                       "logits are divided by when it scores.")
    teacher_engine: dict[str, Any] = Field(default_factory=dict, description="teacher: vllm:NAME: keyword "
                                           "options of its engine (VLLMPolicy, then vllm.LLM), e.g. "
                                           "{gpu_memory_utilization: 0.3} to leave a GPU room for the student.")


    @model_validator(mode="after")
    def _self_needs_privileged(self) -> DistillConfig:
        if self.privileged_source != "env" and not self.privileged:
            raise ValueError("train.distill.privileged_source needs train.distill.privileged=true")
        if self.teacher == "self" and not self.privileged:
            raise ValueError("train.distill.teacher='self' needs train.distill.privileged=true: "
                             "without privileged context the teacher is the student and teaches nothing")
        if self.teacher in ("expert", "oracle") and self.tip:
            raise ValueError("train.distill.tip needs a model teacher: a one-hot expert gives no "
                             "teacher-student gap to select tokens by")
        if self.teacher_engine and not self.teacher.startswith("vllm:"):
            raise ValueError("train.distill.teacher_engine configures a 'vllm:...' teacher's engine only")
        if "max_model_len" in self.teacher_engine:
            raise ValueError("train.distill.teacher_engine.max_model_len is set from rollout.max_context_tokens "
                             "(plus room for a privileged prefix); a shorter one would refuse long episodes")
        top_k_used = self.signal != "reverse_kl" or self.overlap_threshold is not None
        unused = [k for k, ok in (("top_k", top_k_used), ("mask_special", self.signal != "reverse_kl"),
                                  ("jsd_beta", self.signal == "jsd"),
                                  ("overlap_after_weight", self.overlap_threshold is not None))
                  if getattr(self, k) != type(self).model_fields[k].default and not ok]  # a saved config's
                  # defaults, written out, still load
        if unused:
            raise ValueError(f"train.distill.{unused[0]} does nothing with signal={self.signal!r} and "
                             f"overlap_threshold={self.overlap_threshold}")
        if self.signal == "lsm" and self.top_k < 2:
            raise ValueError("train.distill.signal='lsm' with top_k=1 compares one renormalised token: always 0")
        if self.teacher.startswith("vllm:") and (top_k_used or self.teacher_temperature != 1.0):
            raise ValueError("train.distill.teacher='vllm:...' scores the sampled tokens at temperature 1 "
                             "(vLLM's prompt logprobs): use signal='reverse_kl', no overlap_threshold "
                             "and teacher_temperature=1")
        if self.teacher in ("expert", "oracle") and (self.signal not in ("reverse_kl", "forward_kl")
                                                     or self.overlap_threshold is not None):
            raise ValueError("train.distill.teacher='expert' is a one-hot target on the student's own "
                             "tokens: it has no top-k distribution; use signal='reverse_kl' (its sampled "
                             "tokens) or 'forward_kl' (its next token: DAgger), and no "
                             "overlap_threshold")
        if self.teacher in ("expert", "oracle") and self.signal == "forward_kl" and (
                self.turn_balance or self.sod_alpha is not None or self.depth_coverage is not None):
            raise ValueError("train.distill.teacher='expert' with signal='forward_kl' trains on the expert's "
                             "tokens (DAgger) and measures no divergence per turn: turn_balance, sod_alpha "
                             "and depth_coverage need a model teacher or signal='reverse_kl'")
        if self.teacher in ("expert", "oracle") and self.privileged:
            raise ValueError("train.distill.teacher='expert' reads no context: set "
                             "train.distill.privileged=false")
        return self


def distill_weight(cfg: DistillConfig, step: int, total_steps: int) -> float:
    """The distillation weight of step ``step`` (0-based): constant, or linear from weight to weight_end."""
    if cfg.weight_end is None:
        return cfg.weight
    return linear_schedule(step, cfg.weight, cfg.weight_end, cfg.weight_steps or max(total_steps, 1))
