"""The learning step: one rollout batch in, one update of the trained model out.

One job: ``Learner.learn`` runs, top to bottom, every call between a step's
trees and its optimizer steps:

1. **episodes**, built once a tree (``EpisodeGroup``), read by all that follows;
2. **credit**: ``agentrl.credit.assign`` (or ``distill.no_credit``) gives each
   episode's per-token advantages, ``batch.samples_from_credit`` the samples;
3. **scoring**: the trained weights score the action tokens without gradient
   when the update takes more than one optimizer step or a teacher reads them
   (PPO's anchor, ``batch.score_old``; ``needs_scoring_pass``). Without a
   teacher the pass skips the update's first minibatch, which anchors to its
   own forward (``train_on_samples``' ``anchor_first``: the same numbers). The KL
   reference and a distillation teacher (``Distiller.teacher_scores``) score
   the same tokens, each constrained turn (``rollout.constrain``) under its
   sampler's mask (``batch.constrain_samples``);
4. **distillation's advantage term**: ``A += w * (log pi_teacher - log
   pi_student)`` (``Distiller.advantage_term``);
5. **the update**: ``epochs`` shuffled passes of minibatches, one AdamW step each
   (``batch.train_on_samples``), whose loop calls ``loss.row_loss`` on each row;
6. **what it trained on**: the first ``train.output.save_trees`` trees get the
   per-token values the loss read (``token_values``), saved with them.

Nothing here knows the run around it (``trainer``): it gets trees, a step
number and a progress bar factory, and returns stats.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console

from ..credit_options import GAEOptions, GiGPOOptions
from ..errors import ConfigError
from ..policy.base import request_seed
from ..types import EpisodeGroup, RolloutTree
from .batch import (
    Sample,
    constrain_samples,
    minibatches,
    samples_from_credit,
    score_old,
    score_samples,
    shuffled_orders,
    train_on_samples,
)
from .compiled import compile_mode
from .config import TrainRunConfig
from .loss import StepLoss, mismatch_stats
from .metrics import advantage_balance
from .model import (
    base_model,
    dropout_in,
    free_before_update,
    make_optimizer,
    make_scheduler,
    make_trainable,
    precision,
    reference,
    reference_model,
    schedule_at,
)
from .token_values import token_values

__all__ = ["Learner", "no_signal"]

# (phase, total, label) -> a callable that advances that phase's bar by one
StartBar = Callable[[str, int, str], Callable[..., None]]


class Learner:
    """The trained model, its optimizer and schedule, and what scores beside it (the KL
    reference, a distillation teacher, a value head); ``learn`` is one step."""

    def __init__(self, cfg: TrainRunConfig, policy: Any, console: Console | None = None):
        t = cfg.train
        self.cfg = cfg
        self.console = console or Console()
        self.policy = policy  # reads its version and tokenizer; the run syncs its weights
        net = getattr(policy, "model", None)
        if not isinstance(net, torch.nn.Module):
            raise ConfigError(f"policy.backend={cfg.policy.backend!r} holds no torch model to train; "
                              "use backend=hf")
        self.model = make_trainable(net, t)
        self.net = base_model(self.model)
        self.device = next(self.net.parameters()).device
        self.temperature = cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0
        tok = policy.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.ref = reference_model(self.model, t.loss.kl_coef)
        self.value_head = None  # credit: gae's V(s), a probe on the policy's features (value.py)
        if t.value_head is not None:
            from .value import ValueHead
            text = self.net.config.get_text_config() if hasattr(self.net.config, "get_text_config") else self.net.config
            self.value_head = ValueHead(text.hidden_size, t.value_head)
        self.distiller = None
        if t.distill is not None:
            from .distill import Distiller
            self.distiller = Distiller(t.distill, tok, self.device, t.steps, student=self.net,
                                       max_len=cfg.rollout.max_context_tokens + 2048,  # + a privileged prefix
                                       label_max_tokens=cfg.rollout.max_context_tokens, stop=cfg.sampling.stop)
        self.optimizer = make_optimizer(self.model, t.optimizer.lr, t.optimizer)
        # The schedule's plan: each step's share of it, whatever that step's minibatch count (_update).
        self.planned_optimizer_steps = t.epochs * math.ceil(t.tasks_per_step * cfg.rollout.group_size
                                                            / t.minibatch_size)
        self.scheduler = make_scheduler(self.optimizer, t.optimizer, t.steps * self.planned_optimizer_steps)

    def close(self) -> None:
        """Stop the teacher (a vLLM engine) and drop every model and optimizer reference."""
        if self.distiller is not None:
            self.distiller.close()
        self.distiller = self.ref = self.value_head = None
        self.policy = self.model = self.net = self.optimizer = self.scheduler = None  # type: ignore[assignment]

    def needs_scoring_pass(self, n_samples: int) -> bool:
        """Whether old logprobs need their own no-grad pass before the update.

        With one optimizer step per batch (one epoch, one minibatch) the weights
        the update differentiates are the weights PPO's ratio anchors to, so the
        update's own logprobs, detached, are the old ones (ratio 1; TRL's GRPO
        skips the pass the same way when it makes one update per generation).
        A distillation teacher that reads ``Sample.old`` before the update
        keeps the pass. Where it runs, it may leave out the update's first
        minibatch (``anchors_first_minibatch``); with one minibatch and more
        epochs it then scores nothing (``train/scoring_pass`` 0,
        ``train/scored_samples`` 0), and the first epoch's forward is the anchor.
        """
        t = self.cfg.train
        teacher_reads_old = self.distiller is not None and self.distiller.needs_student_scores
        return t.epochs > 1 or n_samples > t.minibatch_size or teacher_reads_old

    def anchors_first_minibatch(self) -> bool:
        """Whether, when the scoring pass runs, the update's first minibatch is left out of it and
        anchors to its own forward instead (``train_on_samples``' ``anchor_first``): the same
        numbers, a pass over one minibatch fewer. A distillation teacher reads every sample's
        scores before the update, and with dropout the update's forward (train mode) is random
        where the pass's (eval mode) is not: both keep the whole pass."""
        return self.distiller is None and not dropout_in(self.model)

    def learn(self, trees: list[RolloutTree], step: int, start_bar: StartBar) -> dict[str, Any]:
        """Credit, scoring passes and the update on one rollout batch, at ``train.precision``."""
        with precision(self.cfg.train.precision), compile_mode(self.cfg.train.compile):
            return self._learn(trees, step, start_bar)

    def _learn(self, trees: list[RolloutTree], step: int, start_bar: StartBar) -> dict[str, Any]:
        t, tree_layout = self.cfg.train, self.cfg.train.tree_packing  # the row layout of both passes
        free_before_update(self.policy, self.model)  # the rollouts' cache and buffers
        t0 = time.perf_counter()
        groups = [EpisodeGroup.of(tr) for tr in trees]  # each tree's episodes, once
        samples, credited, stats = self._credit(groups)
        # Constrained turns are scored under their sampler's mask (rollout.constrain).
        stats["train/constrained_tokens"] = constrain_samples(samples, self.policy.tokenizer)
        why = no_signal(groups, samples, distilling=self.distiller is not None,
                        failed_credited=self.cfg.rollout.failed_episodes == "credit")
        stats["train/no_signal"] = int(why is not None)
        if why is not None:
            self.console.print(f"[yellow]warning:[/] step {step + 1}: no learning signal: {why}",
                               highlight=False)
        if self.distiller is not None:
            self._teacher_context(samples, groups)
        stats["train/episodes"] = len(samples)
        stats["time/credit_s"] = time.perf_counter() - t0
        if not samples:
            self._keep_token_values(groups, samples, credited)
            return stats

        # The scoring passes: old (PPO's anchor), reference (KL), teacher (distillation).
        t0 = time.perf_counter()
        labels: list[Sample] = []  # DAgger: the expert's actions in the student's states, as extra samples
        if self.distiller is not None and self.distiller.labels:
            labels, label_stats = self.distiller.expert_labels(samples, step, self.policy.version)
            stats.update(label_stats)
        batch = samples + labels
        one_step = not self.needs_scoring_pass(len(batch)) and not labels
        # Drawn before the scoring passes, which pack the first epoch's minibatches into the
        # update's rows: the first minibatch's ratio is then exactly 1, in bf16 too.
        orders = shuffled_orders(len(batch), t.epochs, torch.Generator().manual_seed(request_seed(t.seed, step, 1)))
        first = minibatches(orders[0], t.minibatch_size)
        fields: tuple[str, ...] = ("advantages", "behaviour", "versions")
        tokens = 0
        from_sampler = not one_step and t.old_logprobs == "sampler"
        anchor_first = not one_step and not from_sampler and self.anchors_first_minibatch()
        scored = 0
        if from_sampler:  # PPO's anchor is what the sampler returned with each token: no pass
            for s in batch:
                s.old = list(s.behaviour)
            fields += ("old",)
        elif not one_step:
            top_k = self.distiller.top_k if self.distiller is not None else 0
            rest = first[1:] if anchor_first else first
            packing = []  # rest's minibatches, as indices into the samples scored
            for g in rest:
                packing.append(list(range(scored, scored + len(g))))
                scored += len(g)
            if scored:
                tokens += score_old(self.net, [batch[i] for g in rest for i in g], t.micro_batch_tokens,
                                    self.pad_id, self.temperature, top_k=top_k, tree=tree_layout, groups=packing)
            fields += ("old",)
        if t.loss.kl_coef > 0:
            with reference(self.model, self.ref) as ref:
                scores, n = score_samples(ref, batch, t.micro_batch_tokens, self.pad_id, self.temperature,
                                          groups=first)
            for s, sc in zip(batch, scores, strict=True):
                s.ref = sc.logprobs
            tokens += n
            fields += ("ref",)
        if self.distiller is not None and not self.distiller.labels:
            d_stats, token_w = self.distiller.teacher_scores(batch, self._teacher_score(batch))
            tokens += d_stats["distill/teacher_tokens"]
            # Distillation's advantage term: A += w * (log pi_teacher - log pi_student).
            stats.update({**d_stats, **self.distiller.advantage_term(batch, step, token_w)})
        if self.distiller is not None and self.distiller.distribution:
            fields += ("support", "support_teacher", "distill_weights")
        for lab in labels:  # never sampled: its old logprobs stand for the behaviour, no mismatch to correct
            lab.behaviour = list(lab.old or lab.behaviour)
        stats["time/old_logprobs_s"] = time.perf_counter() - t0
        stats["train/scoring_pass"] = int(scored > 0)
        stats["train/scored_samples"] = scored

        # The update: epochs of minibatches, each row's loss from loss.row_loss.
        d = t.distill
        loss = StepLoss(t.loss, self.policy.version, d.signal if d is not None else None,
                        d.jsd_beta if d is not None else 0.5)
        n_updates = t.epochs * math.ceil(len(batch) / t.minibatch_size)
        on_update = self._scheduled(step, n_updates, start_bar("train", n_updates, f"step {step + 1}"))
        t0 = time.perf_counter()
        st = train_on_samples(self.model, self.optimizer, None, batch, loss, fields=fields,  # on_update schedules
                              epochs=t.epochs, minibatch_size=t.minibatch_size, max_tokens=t.micro_batch_tokens,
                              max_grad_norm=t.optimizer.max_grad_norm, per_token=t.loss.agg == "token-mean",
                              pad_id=self.pad_id, temperature=self.temperature,
                              orders=orders, on_minibatch=on_update, tree=tree_layout, anchor_first=anchor_first)
        wall = time.perf_counter() - t0
        self._keep_token_values(groups, samples, credited)  # the values the loss read, now final
        stats.update(st)
        if from_sampler:  # anchored to the sampler, mismatch is 0 and TIS's weight 1 by construction: not measured
            stats = {k: v for k, v in stats.items() if not k.startswith(("mismatch/", "tis/"))}
        else:
            stats.update(self._mismatch(samples, st, one_step))
        stats["time/train_s"] = wall
        stats["train/tokens_per_s"] = (st["train/tokens"] + tokens) / max(wall + stats["time/old_logprobs_s"], 1e-9)
        stats["train/lr"] = self.scheduler.get_last_lr()[0]
        return stats

    def _scheduled(self, step: int, n_updates: int, advance: Callable[..., None]) -> Callable[[], None]:
        """What runs after each of step ``step``'s ``n_updates`` optimizer steps: the learning rate
        moves on by its share of the step's planned optimizer steps, then ``advance``.

        The schedule is planned as ``planned_optimizer_steps`` a step, but a step runs one per
        minibatch of its samples: more with a leaf budget over ``tasks_per_step * group_size`` or
        DAgger's labels, fewer where episodes are left out. Counted one by one, such steps ended a
        decaying schedule early (the rest trained at lr 0) or never reached its end; placed by the
        step, step k starts at ``k * planned_optimizer_steps`` whatever came before it.
        """
        start, planned, done = step * self.planned_optimizer_steps, self.planned_optimizer_steps, 0
        schedule_at(self.scheduler, start)

        def after_update() -> None:
            nonlocal done
            done += 1
            schedule_at(self.scheduler, start + done * planned / n_updates)
            advance()

        return after_update

    def _credit(self, groups: list[EpisodeGroup]) -> tuple[list[Sample], set[int], dict[str, Any]]:
        """Per-token advantages for every episode (and a refit value head), as samples; and the
        ``id``s of the episodes credit gave advantages to (the rest it left out)."""
        from ..credit import assign

        t = self.cfg.train
        stats: dict[str, Any] = {}
        if t.credit.name == "none":
            from .distill import no_credit
            items = no_credit(groups)
        else:
            options: dict[str, Any] = {"failed": self.cfg.rollout.failed_episodes}
            feats: dict[tuple[int, ...], tuple[torch.Tensor, Any]] = {}
            if self.value_head is not None:
                from .value import turn_features

                def value_fn(ep: Any) -> list[float]:
                    key = tuple(id(n) for n in ep.nodes)
                    if key not in feats:
                        feats[key] = (turn_features(self.net, ep), ep)
                    return self.value_head(feats[key][0]).tolist()

                options["value_fn"] = value_fn
            items = assign(groups, t.credit, **options)
            if isinstance(t.credit, GiGPOOptions):  # how often states recur: GiGPO's step level needs them
                from ..credit import anchor_group_stats
                stats.update(anchor_group_stats(groups, t.credit.similarity))
            if self.value_head is not None and feats:  # refit V on this batch, after it was used
                assert isinstance(t.credit, GAEOptions)  # the config allows a value head with gae only
                stats.update(self.value_head.fit([f for f, _ in feats.values()], [e for _, e in feats.values()],
                                                 t.credit.gamma, t.credit.lam))
        skip = (t.skip_zero_advantage and t.loss.kl_coef == 0 and t.loss.entropy_coef == 0
                and self.distiller is None)
        samples = samples_from_credit(items, skip_zero_advantage=skip)
        stats["adv/token_balance"] = advantage_balance([s.advantages for s in samples], [s.mask for s in samples])
        return samples, {id(ep) for ep, _ in items}, stats

    def _keep_token_values(self, groups: list[EpisodeGroup], samples: list[Sample], credited: set[int]) -> None:
        """Put what the update read on the trees the run saves (``train.output.save_trees``), for the viewer."""
        t = self.cfg.train
        for g in groups[:t.output.save_trees]:
            g.tree.meta["token_values"] = token_values(g, samples, credited, t.credit.name)

    def _teacher_context(self, samples: list[Sample], groups: list[EpisodeGroup]) -> None:
        """What the distillation teacher reads of each sample's episode: its tree's privileged
        text (the env's, or a hindsight summary of the group), and the expert's action each turn."""
        from .distill import hindsight_summary

        assert self.distiller is not None
        group_of = {id(e.nodes[0]): g for g in groups for e in g.episodes if e.nodes}  # an episode's group
        hindsight = self.distiller.cfg.privileged_source == "hindsight"
        texts: dict[int, str | None] = {}
        for s in samples:
            ep = s.episode
            if ep is None or not ep.nodes:
                continue
            group = group_of[id(ep.nodes[0])]
            if id(group) not in texts:  # one text per tree: the group of one task
                texts[id(group)] = (hindsight_summary(group, self.policy.tokenizer) if hindsight
                                    else group.tree.meta.get("privileged"))
            s.distill.privileged = texts[id(group)]
            s.distill.expert_turns = [(a, b, n.expert_action, n.finish_reason in ("stop", "stop_string"))
                                      for (a, b), n in zip(ep.turn_spans, ep.nodes, strict=True)]

    def _teacher_score(self, batch: list[Sample]) -> Callable[..., Any]:
        """The teacher's scoring pass, in the student's row layout, with room for a privileged prefix."""
        t = self.cfg.train
        room = max(t.micro_batch_tokens, max(len(x.input_ids) for x in batch))

        def score(net: torch.nn.Module, ss: list[Sample], temp: float, **kw: Any) -> Any:
            return score_samples(net, ss, max(room, max(len(x.input_ids) for x in ss)), self.pad_id, temp,
                                 tree=t.tree_packing, **kw)

        return score

    @staticmethod
    def _mismatch(samples: list[Sample], st: dict[str, Any], one_step: bool) -> dict[str, float]:
        """How far the sampler's logprobs are from the trainer's, before the update."""
        if one_step:  # no scoring pass: the loss compared its own detached logprobs with the behaviour ones
            return {"mismatch/kl": st.get("mismatch/mismatch_kl", 0.0)}
        flat = lambda get: torch.tensor([x for s in samples for x in get(s)])  # noqa: E731
        mm = mismatch_stats(flat(lambda s: s.old), flat(lambda s: s.behaviour), flat(lambda s: s.mask).bool())
        return {"mismatch/kl": mm["mismatch_kl"], "mismatch/max_abs_dlogprob": mm["max_abs_dlogprob"]}


def no_signal(groups: list[EpisodeGroup], samples: list[Sample], distilling: bool = False,
              failed_credited: bool = False) -> str | None:
    """Why this step has no policy-gradient signal, or None when it has one. ``failed_credited``:
    failed episodes are trained as ordinary ones (``rollout.failed_episodes: credit``)."""
    if distilling:  # the teacher's advantages come later
        return None
    episodes = [ep for g in groups for ep in g.episodes]
    if not episodes:
        return "the rollout produced no episode"
    if not failed_credited and all(ep.error for ep in episodes):
        return f"all {len(episodes)} episodes failed (first: {episodes[0].error.splitlines()[0]})"
    if not samples:
        return ("every episode's advantages are zero (each group's episodes got the same reward), "
                "and train.skip_zero_advantage left them all out; more episodes per group "
                "(rollout.group_size) or a task the policy sometimes solves gives a signal")
    if all(a == 0.0 for x in samples for a, m in zip(x.advantages, x.mask, strict=True) if m):
        return ("every advantage is zero (each group's episodes got the same reward): only the KL "
                "or entropy term trains")
    return None
