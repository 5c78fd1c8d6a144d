"""The teacher in the learning step (``Distiller``): it scores a batch's tokens and adds its signal.

One job: wire the teacher into a scored rollout batch; on-policy
distillation, where a frozen teacher scores the student's own turns.
The student samples, the trainer scores the student's tokens (``Sample.old``),
the teacher scores the *same* token ids (``Distiller.teacher_scores``; never
re-tokenized, so it must share the student's tokenizer), and
``Distiller.advantage_term`` turns the two into

- an advantage added to the RL one on every action token (``signal:
  reverse_kl``): ``A_t = A_rl_t + w(step) * w_t * (log pi_teacher - log pi_student)``
  (``advantages.add_distill_advantages``; ``train.credit: none`` leaves the
  teacher's term alone, which is plain GKD-style OPD, ``no_credit``), or
- the weights of a loss term on a top-K support of candidate ids
  (``topk_reverse_kl``, ``lsm``, ``forward_kl``, ``jsd``), whose gradient
  reaches every candidate (``signals.distribution_loss``).

Teachers (loaded in ``teachers``): a model folder or registered name, a vLLM
engine (``vllm:NAME``), the student's own weights given privileged text
(``self``; OPSD), or the env's scripted expert or privileged oracle as a
one-hot target on the student's tokens (``expert``, ``oracle``): on its
sampled tokens with ``reverse_kl`` (``advantages.expert_teacher_logprobs``), or, with
``forward_kl``, the expert's whole action at the turns where the student left
it, as extra samples: DAgger on the student's states (``Distiller.expert_labels``).

Per-token and per-turn weights (TurnOPD, SOD, TIP, the overlap stop, the
depth budget) each come from one function in ``signals``, named in the
config field (``config.DistillConfig``) that switches it on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import ConfigError
from ...types import Episode, EpisodeGroup
from ..batch import Sample, SampleScores
from .advantages import add_distill_advantages, expert_teacher_logprobs, overlap_weights
from .config import DistillConfig, distill_weight
from .signals import build_support, depth_budget, informative_token_mask
from .teachers import document_bos, load_teacher, load_vllm_teacher, privileged_prefix

__all__ = ["Distiller", "ScoreFn", "no_credit"]


def no_credit(groups: Sequence[EpisodeGroup]) -> list[tuple[Episode, list[float]]]:
    """``train.credit: none``: every kept episode with all-zero RL advantages (failed ones left out)."""
    return [(ep, [0.0] * len(ep.input_ids)) for g in groups for ep in g.episodes if not ep.error]


# (model, samples, temperature, top_k=..., candidates=...) -> (each sample's scores, tokens run)
ScoreFn = Callable[..., tuple[list[SampleScores], int]]


class Distiller:
    """Holds the teacher: ``teacher_scores`` scores a batch, ``advantage_term`` adds its signal."""

    def __init__(self, cfg: DistillConfig, student_tokenizer: Any, device: torch.device,
                 total_steps: int, student: torch.nn.Module | None = None, max_len: int = 4096,
                 vllm_teacher: Any = None, label_max_tokens: int | None = None, stop: Sequence[str] = ()):
        self.cfg = cfg
        self.stop = tuple(stop)  # sampling.stop: a scripted expert's turn may end with one
        self.label_max_tokens = label_max_tokens  # DAgger's longest label: rollout.max_context_tokens
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
            s.distill.teacher, t, m = expert_teacher_logprobs(s, self.tokenizer, self.cfg.expert_floor, self.stop)
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
        then the expert's action tokens and the end token, which alone carry loss. A label longer than
        ``label_max_tokens`` (the context budget, which ``train.micro_batch_tokens`` may equal; a turn the
        budget cut short) is left out, and counted (``distill/expert_labels_too_long``). Its loss term is
        ``forward_kl`` to a one-hot teacher on its own tokens, so ``-w log pi(expert token)``; its
        advantages are 0, so the policy-gradient term leaves it alone. The context is the student's,
        token for token; only the label is the expert's text, tokenized as SFT tokenizes it.
        """
        eos = self.tokenizer.eos_token_id
        w = distill_weight(self.cfg, step, self.total_steps)
        out: list[Sample] = []
        turns = differing = too_long = 0
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
                n = len(want)
                if self.label_max_tokens is not None and start + n > self.label_max_tokens:
                    too_long += 1  # no row could hold it
                    continue
                taken += 1
                label = Sample(s.input_ids[:start] + want, [0] * start + [1] * n, s.behaviour[:start] + [0.0] * n,
                               [0.0] * (start + n), s.versions[:start] + [version] * n, episode=s.episode,
                               turn_spans=[(start, start + n)])
                d = label.distill
                d.support = [[-1]] * start + [[t] for t in want]
                d.support_teacher = [[0.0]] * (start + n)
                d.weights = [0.0] * start + [w] * n
                out.append(label)
        return out, {"distill/expert_turns": turns, "distill/expert_match_frac": 1 - differing / max(turns, 1),
                     "distill/expert_labels": len(out), "distill/expert_labels_too_long": too_long,
                     "distill/weight": w, "distill/teacher_tokens": 0}

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
        """Fold this batch's per-turn divergence into ``turn_mass`` (half old, half new) and re-budget.

        The divergence is over every action token, those TIP left out of the loss included."""
        mass: list[float] = []
        for s in samples:
            old, teacher = s.old or [], s.distill.teacher or []
            mask = s.distill.action_mask or s.mask
            for k, (a, b) in enumerate(s.turn_spans or []):
                gap = sum(abs(x - y) * m for x, y, m in zip(old[a:b], teacher[a:b], mask[a:b], strict=True))
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
            # A constrained turn's tokens keep their mask (rollout.constrain), shifted past the prefix.
            shift = len(prefix) - cut
            allowed = {t + shift: ids for t, ids in s.allowed.items() if t >= cut} if s.allowed else None
            views.append(Sample(prefix + s.input_ids[cut:], [0] * len(prefix) + s.mask[cut:], [], [], [],
                                old_top=[[-1] * k] * len(prefix) + s.old_top[cut:] if k else None,
                                allowed=allowed or None))
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
                                        both=both, special=self._special, vocab=self._vocab,
                                        allowed=s.allowed)
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
            s.distill.action_mask = s.mask  # TurnOPD's depth statistic still reads every action token
            s.mask = [int(k) for k in keep[start:start + n].tolist()]
            start += n
        dropped = int(mask.sum() - keep.sum())
        return {"distill/tip_kept_frac": frac, "distill/tip_dropped_tokens": dropped,
                "distill/tip_logits_mb_saved": dropped * 2 * 4 * len(self.tokenizer) / 2**20}
