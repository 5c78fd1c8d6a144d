"""On-policy distillation in the RL loop: a frozen teacher scores the student's own turns.

One job: wire the pure signals of ``signals`` into a scored rollout batch.
The student samples, the trainer scores the student's tokens (``Sample.old``),
the teacher scores the *same* token ids (``Distiller.teacher_scores``; never
re-tokenized, so it must share the student's tokenizer), and
``Distiller.advantage_term`` turns the two into

- an advantage added to the RL one on every action token (``signal:
  reverse_kl``): ``A_t = A_rl_t + w(step) * w_t * (log pi_teacher - log pi_student)``
  (``add_distill_advantages``; ``train.credit: none`` leaves the teacher's
  term alone, which is plain GKD-style OPD), or
- the weights of a loss term on a top-K support of candidate ids
  (``topk_reverse_kl``, ``lsm``, ``forward_kl``, ``jsd``), whose gradient
  reaches every candidate (``signals.distribution_loss``).

Teachers: a model folder or registered name (``load_teacher``), a vLLM
engine (``vllm:NAME``), the student's own weights given privileged text
(``self``; OPSD), or the env's scripted expert or privileged oracle as a
one-hot target on the student's tokens (``expert``, ``oracle``): on its
sampled tokens with ``reverse_kl`` (``expert_teacher_logprobs``), or, with
``forward_kl``, the expert's whole action at the turns where the student left
it, as extra samples: DAgger on the student's states (``Distiller.expert_labels``). Privileged text comes from the env's reset
``info["privileged"]`` or, with ``privileged_source: hindsight``, from the
group's own best episode (``hindsight_summary``); it is a system message in
front of the student's ids (``privileged_prefix``).

Per-token and per-turn weights (TurnOPD, SOD, TIP, the overlap stop, the
depth budget) each come from one function in ``signals``, named in the
config field that switches it on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...errors import ConfigError
from ...types import Episode, EpisodeGroup, RolloutTree
from ..batch import Sample, SampleScores
from .signals import (
    build_support,
    combine_rl_and_distill,
    depth_budget,
    expert_one_hot_teacher,
    informative_token_mask,
    linear_schedule,
    overlap_stop,
    reverse_kl_advantage,
    spread_turn_values,
    step_divergence_weights,
    turn_balance_weights,
)

__all__ = ["DistillConfig", "Distiller", "ScoreFn", "add_distill_advantages", "distill_weight",
           "document_bos", "expert_teacher_logprobs", "hindsight_summary", "load_teacher",
           "load_vllm_teacher", "no_credit", "overlap_weights", "privileged_prefix"]


class DistillConfig(BaseModel):
    """The ``train.distill`` section: who teaches, with which signal, how strongly."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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


def load_teacher(name: str, student_tokenizer: Any, device: torch.device) -> torch.nn.Module:
    """The frozen teacher model; refuses one whose tokenizer differs from the student's."""
    from ...models import load_model

    try:
        model, tokenizer = load_model(name, device=str(device))
    except Exception as e:  # an unknown name or a folder transformers cannot read
        raise ConfigError(f"train.distill.teacher={name!r}: cannot load it ({e})") from e
    if tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(f"train.distill.teacher={name!r} has another tokenizer than the student; "
                          "the teacher scores the student's token ids, so they must share one")
    return model.requires_grad_(False).eval()


def load_vllm_teacher(name: str, student_tokenizer: Any, max_len: int, **engine: Any) -> Any:
    """A vLLM engine in this process that scores as the teacher (``teacher: vllm:NAME``)."""
    from ...policy.vllm import VLLMPolicy

    try:
        teacher = VLLMPolicy(name, **{**engine, "max_model_len": max_len})  # the rollouts set it
    except Exception as e:
        raise ConfigError(f"train.distill.teacher='vllm:{name}': cannot start it ({e})") from e
    if teacher.tokenizer.get_vocab() != student_tokenizer.get_vocab():
        teacher.close()
        raise ConfigError(f"train.distill.teacher='vllm:{name}' has another tokenizer than the student")
    return teacher


def no_credit(groups: Sequence[EpisodeGroup]) -> list[tuple[Episode, list[float]]]:
    """``train.credit: none``: every kept episode with all-zero RL advantages (failed ones left out)."""
    return [(ep, [0.0] * len(ep.input_ids)) for g in groups for ep in g.episodes if not ep.error]


# (model, samples, temperature, top_k=..., candidates=...) -> (each sample's scores, tokens run)
ScoreFn = Callable[..., tuple[list[SampleScores], int]]


def privileged_prefix(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as a system message, rendered with the chat template.

    A template that cannot render a lone system message gets ``text`` and a
    blank line as plain tokens instead.
    """
    msg = [{"role": "system", "content": f"Privileged information (the agent cannot see it): {text}"}]
    try:
        ids = tokenizer.apply_chat_template(msg, tokenize=True, add_generation_prompt=False)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)
    except Exception:  # a template that refuses a lone system message
        return tokenizer(msg[0]["content"] + "\n\n", add_special_tokens=False)["input_ids"]


def hindsight_summary(tree: RolloutTree | EpisodeGroup, tokenizer: Any, max_tokens: int = 1024) -> str:
    """Privileged text from a group's own rollouts of one task (SD-Search / OPSD-style hindsight).

    The group's best episode (highest return; the first on ties) as its
    decoded actions (cut after about ``max_tokens``), with its return and how
    many attempts it was picked from. Written after the group ran, so the
    teacher knows what worked on *this* task and scores each of the group's
    turns in that light. When every attempt got the same return there is no
    best one to point at, and the text says only that.
    """
    episodes = [ep for ep in EpisodeGroup.of(tree).episodes if not ep.error and ep.nodes]
    if not episodes:
        return "Hindsight: no attempt at this task ran without an error."
    returns = [ep.total_reward for ep in episodes]
    if len(episodes) < 2 or max(returns) == min(returns):  # no better attempt to point at
        return (f"Hindsight from {len(episodes)} attempt(s) at this task: all got return {returns[0]:g}; "
                "none did better.")
    best = max(episodes, key=lambda ep: ep.total_reward)
    head = (f"Hindsight from {len(episodes)} attempts at this task. The best one (return "
            f"{best.total_reward:g}) took these actions: ")
    actions, used = [], len(tokenizer(head, add_special_tokens=False)["input_ids"])
    for n in best.nodes:  # at most max_tokens: the teacher's context has room for so much
        text = tokenizer.decode(n.action_ids, skip_special_tokens=True).strip()
        used += len(n.action_ids) + 1
        if used > max_tokens:
            actions.append("...")
            break
        actions.append(text)
    return head + "; ".join(actions)


def document_bos(tokenizer: Any) -> int | None:
    """The BOS id if the chat template writes it once, at a conversation's start; else None.

    Some tokenizers name a turn marker their BOS (SmolLM2's is ``<|im_start|>``,
    which opens every message): dropping that from the student's ids would leave
    its first turn without its opening tag.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    try:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    except Exception:  # no usable template: keep every token
        return None
    return bos if list(ids).count(bos) == 1 and list(ids)[:1] == [bos] else None


class Distiller:
    """Holds the teacher: ``teacher_scores`` scores a batch, ``advantage_term`` adds its signal."""

    def __init__(self, cfg: DistillConfig, student_tokenizer: Any, device: torch.device,
                 total_steps: int, student: torch.nn.Module | None = None, max_len: int = 4096,
                 vllm_teacher: Any = None):
        self.cfg = cfg
        self.total_steps = total_steps
        self.tokenizer = student_tokenizer
        self.teacher: torch.nn.Module | None
        self.vllm_teacher = None  # a VLLMPolicy that scores through prompt logprobs
        self._owns_vllm_teacher = vllm_teacher is None  # one it loaded itself, ``close`` stops
        if cfg.teacher.startswith("vllm:"):
            self.teacher = None
            self.vllm_teacher = vllm_teacher or load_vllm_teacher(cfg.teacher[5:], student_tokenizer, max_len,
                                                                  **cfg.teacher_engine)
        elif cfg.teacher == "self":
            if student is None:
                raise ConfigError("train.distill.teacher='self' needs the student model")
            self.teacher = student
        elif cfg.teacher in ("expert", "oracle"):
            self.teacher = None
        else:
            self.teacher = load_teacher(cfg.teacher, student_tokenizer, device)
        self._prefixes: dict[str, list[int]] = {}
        self.turn_mass: list[float] = []  # per turn depth: divergence mass, averaged over steps (TurnOPD)
        self.depth_budget: int | None = None  # the next rollouts' max_turns, once there is a statistic
        self.distribution = cfg.signal != "reverse_kl"  # a loss term on a top-k support, not an advantage
        self.scripted = cfg.teacher in ("expert", "oracle")  # a one-hot teacher from the env, no model
        # Candidate ids a token both models report: the support, and the overlap stop's top-k.
        # A scripted teacher's labels carry their own one-token support (``expert_labels``).
        wants_top_k = (self.distribution and not self.scripted) or cfg.overlap_threshold is not None
        self.top_k = cfg.top_k if wants_top_k else 0
        self._bos = document_bos(student_tokenizer)
        self._vocab = len(student_tokenizer)  # a bigger teacher head may rank padding ids past it
        special = sorted(set(student_tokenizer.all_special_ids)) if cfg.mask_special else []
        self._special = torch.tensor(special, dtype=torch.long) if special else None

    def close(self) -> None:
        """Let the teacher go: a vLLM engine this distiller started is stopped (its driver
        thread would keep it, and its memory, alive), and the model references dropped."""
        if self.vllm_teacher is not None and self._owns_vllm_teacher:
            self.vllm_teacher.close()
        self.vllm_teacher = self.teacher = None

    def _weights(self, step: int) -> dict[str, float | None]:
        progress = min(step / max(self.total_steps - 1, 1), 1.0)
        return {"turn_balance": progress if self.cfg.turn_balance else None, "sod_alpha": self.cfg.sod_alpha}

    def _expert_teacher(self, samples: list[Sample]) -> dict[str, float]:
        turns = matched = 0
        for s in samples:
            s.distill.teacher, t, m = expert_teacher_logprobs(s, self.tokenizer, self.cfg.expert_floor)
            turns, matched = turns + t, matched + m
        if turns == 0 and any(s.distill.expert_turns for s in samples):
            raise ConfigError(f"train.distill.teacher={self.cfg.teacher!r} but no turn has an expert action: "
                              f"the env has no {self.cfg.teacher}_action(), or it failed (see the nodes' "
                              "expert_action_error)")
        return {"distill/expert_turns": turns, "distill/expert_match_frac": matched / max(turns, 1)}

    @property
    def needs_student_scores(self) -> bool:
        """Whether ``teacher_scores`` reads the student's scoring pass (``Sample.old``): every teacher but a
        scripted one with ``forward_kl``, whose targets are the expert's own tokens (``expert_labels``)."""
        return not self.labels

    @property
    def labels(self) -> bool:
        """A scripted teacher with ``forward_kl``: DAgger's expert labels (``expert_labels``)."""
        return self.scripted and self.distribution

    def expert_labels(self, samples: list[Sample], step: int, version: int) -> tuple[list[Sample], dict[str, float]]:
        """DAgger (Ross et al. 2011, "A Reduction of Imitation Learning and Structured Prediction to
        No-Regret Online Learning"): the states the student visited, labelled with the expert's action.

        For each of the first ``expert_label_turns`` turns of an episode where the student did
        something else than the expert, one more sample: the student's context up to that turn,
        then the expert's action tokens and the end token, which alone carry loss. Its loss term is
        ``forward_kl`` to a one-hot teacher on its own tokens, so ``-w log pi(expert token)``; its
        advantages are 0, so the policy-gradient term leaves it alone. The context is the student's,
        token for token; only the label is the expert's text, tokenized as SFT tokenizes it.
        """
        eos = self.tokenizer.eos_token_id
        w = distill_weight(self.cfg, step, self.total_steps)
        out: list[Sample] = []
        turns = differing = 0
        for s in samples:
            taken = 0
            n_ids = len(s.input_ids)  # the student's own tokens carry no distillation term
            s.distill.support, s.distill.support_teacher, s.distill.weights = [[-1]] * n_ids, [[0.0]] * n_ids, [0.0] * n_ids
            for start, end, expert, _ in s.distill.expert_turns or []:
                if expert is None or end <= start:
                    continue
                turns += 1
                want = self.tokenizer(expert, add_special_tokens=False)["input_ids"] + [eos]
                if s.input_ids[start:end] == want:
                    continue
                differing += 1
                if taken >= self.cfg.expert_label_turns:
                    continue
                taken += 1
                n = len(want)
                label = Sample(s.input_ids[:start] + want, [0] * start + [1] * n, s.behaviour[:start] + [0.0] * n,
                               [0.0] * (start + n), s.versions[:start] + [version] * n, episode=s.episode,
                               turn_spans=[(start, start + n)])
                d = label.distill
                d.support = [[-1]] * start + [[t] for t in want]
                d.support_teacher = [[0.0]] * (start + n)
                d.weights = [0.0] * start + [w] * n
                out.append(label)
        return out, {"distill/expert_turns": turns, "distill/expert_match_frac": 1 - differing / max(turns, 1),
                     "distill/expert_labels": len(out), "distill/weight": w, "distill/teacher_tokens": 0}

    def advantage_term(self, samples: list[Sample], step: int,
                       token_weights: list[torch.Tensor] | None = None) -> dict[str, float]:
        """``A += w * w_t * (log pi_teacher - log pi_student)`` on every action token of the
        teacher-scored ``samples`` (``add_distill_advantages``; with a distribution-level signal
        ``w * w_t`` becomes that loss term's weights instead), then the depth budget's update."""
        w = distill_weight(self.cfg, step, self.total_steps)
        kl = add_distill_advantages(samples, w, **self._weights(step), loss_weights=self.distribution,
                                    token_weights=token_weights)
        stats = {"distill/reverse_kl": kl, "distill/weight": w}
        if self.cfg.depth_coverage is not None:
            stats.update(self._update_depth(samples))
        return stats

    def set_turn_mass(self, turn_mass: list[float]) -> None:
        """Per-turn divergence statistics (from ``_update_depth`` or a checkpoint), and the budget they give."""
        self.turn_mass = [float(x) for x in turn_mass]
        if self.cfg.depth_coverage is not None:
            self.depth_budget = depth_budget(self.turn_mass, self.cfg.depth_coverage, self.cfg.depth_min_turns)

    def _update_depth(self, samples: list[Sample]) -> dict[str, float]:
        """Fold this batch's per-turn divergence into ``turn_mass`` (half old, half new) and re-budget."""
        mass: list[float] = []
        for s in samples:
            old, teacher = s.old or [], s.distill.teacher or []
            for k, (a, b) in enumerate(s.turn_spans or []):
                gap = sum(abs(x - y) * m for x, y, m in zip(old[a:b], teacher[a:b], s.mask[a:b], strict=True))
                mass += [0.0] * (k + 1 - len(mass))
                mass[k] += gap
        old_mass = self.turn_mass
        # An exponential average over the steps that reached turn k+1.
        self.set_turn_mass([0.5 * (old_mass[k] + m) if k < len(old_mass) else m for k, m in enumerate(mass)]
                           + old_mass[len(mass):])
        return {"distill/depth_budget": self.depth_budget}

    def _privileged_views(self, samples: list[Sample]) -> tuple[list[Sample], list[tuple[int, int]]]:
        """Each sample as the teacher sees it, its privileged text in front; (views, (prefix length, cut))."""
        if any(s.distill.privileged is None for s in samples):
            raise ConfigError("train.distill.privileged=true but the env gave no info['privileged'] "
                              "at reset for some episodes")
        views, offsets, bos, k = [], [], self._bos, self.top_k
        for s in samples:
            text = s.distill.privileged
            if text not in self._prefixes:
                if len(self._prefixes) >= 4096:  # hindsight texts are new each step: keep the memo bounded
                    self._prefixes.clear()
                self._prefixes[text] = privileged_prefix(self.tokenizer, text)
            prefix = self._prefixes[text]
            # A prefix that opens with a document BOS replaces the student's own (one BOS a sequence).
            cut = int(bos is not None and prefix[:1] == [bos] and s.input_ids[:1] == [bos])
            offsets.append((len(prefix), cut))
            views.append(Sample(prefix + s.input_ids[cut:], [0] * len(prefix) + s.mask[cut:], [], [], [],
                                old_top=[[-1] * k] * len(prefix) + s.old_top[cut:] if k else None))
        return views, offsets

    def teacher_scores(self, samples: list[Sample], score: ScoreFn
                       ) -> tuple[dict[str, float], list[torch.Tensor] | None]:
        """The teacher's scores of ``samples``' tokens (their ``old`` must be filled), into ``Sample.distill``.

        ``score(model, samples, temperature, top_k=..., candidates=...)`` returns
        each sample's ``SampleScores`` and the tokens it ran. With
        ``privileged: true`` the teacher reads each sample's
        ``distill.privileged`` text first. TIP drops uninformative tokens from the
        masks, and a distribution-level signal gets its support. Returns ``distill/*``
        stats and the overlap stop's per-token weights (None without it).
        """
        if self.teacher is None and self.vllm_teacher is None:
            return {**self._expert_teacher(samples), "distill/teacher_tokens": 0}, None
        k = self.top_k
        if k and any(s.old_top is None for s in samples):
            raise ValueError(f"train.distill.signal={self.cfg.signal!r} / overlap_threshold need the "
                             "student's top-k ids (Sample.old_top) from its scoring pass")
        views, offsets = (self._privileged_views(samples) if self.cfg.privileged
                          else (samples, [(0, 0)] * len(samples)))
        if self.vllm_teacher is not None:
            scores = [SampleScores([lp if m else 0.0 for lp, m in zip(lps, v.mask, strict=True)], [])
                      for v, lps in zip(views, self.vllm_teacher.score([v.input_ids for v in views]), strict=True)]
            tokens = sum(len(v.input_ids) for v in views)
        else:
            with torch.no_grad():
                scores, tokens = score(self.teacher, views, self.cfg.teacher_temperature,
                                       **({"top_k": k, "candidates": "old_top"} if k else {}))
        for s, sc, (n_prefix, cut) in zip(samples, scores, offsets, strict=True):
            d = s.distill  # a dropped BOS is context: logprob 0, no candidates
            d.teacher = [0.0] * cut + sc.logprobs[n_prefix:]
            if k:
                d.teacher_top = [[-1] * k] * cut + sc.top_ids[n_prefix:]
                d.teacher_top_logprobs = [[0.0] * k] * cut + sc.top_logprobs[n_prefix:]
                d.teacher_at_student_top = [[0.0] * k] * cut + sc.candidates[n_prefix:]
        stats: dict[str, float] = {"distill/teacher_tokens": tokens}
        # The overlap stop reads every action token, before TIP drops some from the mask.
        token_w = None
        if self.cfg.overlap_threshold is not None:
            token_w, overlap_stats = overlap_weights(samples, self.cfg.overlap_threshold,
                                                     self.cfg.overlap_after_weight)
            stats.update(overlap_stats)
        if self.cfg.tip:
            stats.update(self._informative_tokens(samples))
        if self.distribution:
            both = self.cfg.signal in ("forward_kl", "jsd")  # the teacher's mass outside the student's top-K
            for s in samples:
                d = s.distill
                ids, lp = build_support(torch.tensor(s.old_top), torch.tensor(d.teacher_at_student_top),
                                        torch.tensor(d.teacher_top), torch.tensor(d.teacher_top_logprobs),
                                        both=both, special=self._special, vocab=self._vocab)
                d.support, d.support_teacher = ids.tolist(), lp.tolist()
        return stats, token_w

    def _informative_tokens(self, samples: list[Sample]) -> dict[str, float]:
        """TIP: drop uninformative action tokens from every sample's loss mask, in place.

        Quantiles are over the batch's action tokens. A dropped token needs no
        vocabulary head in the update: its logits and their gradient (fp32,
        ``2 * 4 * V`` bytes a token) are the memory reported as saved.
        """
        if any(s.old_entropy is None for s in samples):
            raise ValueError("train.distill.tip needs the student's entropies (Sample.old_entropy)")
        ent = torch.tensor([x for s in samples for x in s.old_entropy])
        gap = torch.tensor([abs(a - b) for s in samples for a, b in zip(s.old, s.distill.teacher, strict=True)])
        mask = torch.tensor([m for s in samples for m in s.mask], dtype=torch.bool)
        keep, frac = informative_token_mask(ent, gap, mask)
        start = 0
        for s in samples:
            n = len(s.mask)
            s.mask = [int(k) for k in keep[start:start + n].tolist()]
            start += n
        dropped = int(mask.sum() - keep.sum())
        return {"distill/tip_kept_frac": frac, "distill/tip_dropped_tokens": dropped,
                "distill/tip_logits_mb_saved": dropped * 2 * 4 * len(self.tokenizer) / 2**20}


def expert_teacher_logprobs(sample: Sample, tokenizer: Any, floor: float) -> tuple[list[float], int, int]:
    """The teacher log-probs of a scripted expert, from ``sample.distill.expert_turns``; (logprobs,
    turns, matched turns).

    ``expert_turns`` holds ``(start, end, expert_action, stopped)`` per turn: the
    turn's action tokens are ``input_ids[start:end]``. A turn without an expert
    action gets the student's own logprobs (no signal). The expert's action is
    tokenized alone; when the student's turn stopped (a stop token or string)
    right after the expert's text, its stop tokens count as matching too.
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
        if stopped and action[:len(want)] == want:  # the expert's text, then the student's stop tokens
            want = action
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
      ``|log pi_s - log pi_t|`` over turn k's action tokens (``step_divergence_weights``).

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
            if sod_alpha is not None:
                gap = a_distill.abs()
                d = [float(gap[a:b].mean()) if b > a else 0.0 for a, b in spans]
                w = w * spread_turn_values(spans, step_divergence_weights(d, sod_alpha), len(s.input_ids))
        if token_weights is not None:
            w = w * token_weights[i]
        if loss_weights:
            s.distill.weights = (weight * w * mask).tolist()
        else:
            s.advantages = combine_rl_and_distill(torch.tensor(s.advantages), w * a_distill, weight).tolist()
    return gap_sum / max(n, 1)
