"""The RL loop: rollout, credit, scoring, update, weight sync, eval, checkpoint.

One step of ``Trainer.run`` (step k trains on the task seeds of step k, so the
step *is* the data position and a resumed run sees the same data):

1. **rollout**: a collect function (``agentrl.rollout.collect``, or a
   harness's) grows one tree per task seed, ``rollout.group_size`` episodes
   each, under the policy's current weights;
2. **credit**: ``agentrl.credit.assign`` turns trees into per-token
   advantages, and ``batch.samples_from_credit`` into samples;
3. **scoring**: when the update takes more than one optimizer step, or a
   distillation teacher needs them, the trainer scores every action token
   under its own weights without gradient (PPO's anchor, compared with the
   rollout's behaviour logprobs and reweighted by TIS); with one optimizer
   step the update's own detached logprobs are the anchor
   (``needs_scoring_pass``). A reference model (KL) and a teacher
   (``distill``) score the same tokens;
4. **update**: ``epochs`` passes of minibatches, one AdamW step each
   (``batch.train_on_samples``);
5. **sync**: the policy gets the new weights (``batch.sync_policy``);
6. **eval** on held-out task seeds every ``eval_every`` steps, and
   **checkpoint** every ``checkpoint_every`` steps.

With ``train.asynchronous`` the rollouts of the next steps run in a producer
thread, from a copy of the weights (a snapshot in this process, or the
rollout workers' own), while this step trains (``agentrl.train.asynchronous``);
step 1 then takes its trees from that queue and step 5 also refreshes the copy.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from ..errors import ConfigError
from ..policy.base import request_seed
from ..policy.snapshot import SnapshotPolicy
from ..types import RolloutTree, write_trees
from .asynchronous import RolloutProducer
from .batch import (
    Row,
    Sample,
    base_model,
    make_optimizer,
    make_scheduler,
    make_trainable,
    precision,
    samples_from_credit,
    score_old,
    score_samples,
    sync_policy,
    train_on_samples,
)
from .checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_trainable,
    restore_rng,
    save_checkpoint,
)
from .config import TrainRunConfig
from .loss import mismatch_stats, policy_loss
from .metrics import MetricsLogger, PeakMemory, advantage_balance, plot_learning_curve
from .plan import eval_seeds, print_plan, run_plan, step_task_seeds

__all__ = [
    "CollectFn",
    "Trainer",
    "eval_seeds",
    "evaluate",
    "run_plan",
    "step_task_seeds",
    "train",
]

# (env id, policy, config, task seeds, on_episode_done=...) -> one tree per seed
CollectFn = Callable[..., list[RolloutTree]]


# --------------------------------------------------------------------------- eval


def evaluate(policy: Any, cfg: TrainRunConfig, on_episode_done: Callable | None = None,
             collect_fn: Callable[..., list[RolloutTree]] | None = None) -> dict[str, Any]:
    """Success and reward on ``eval_episodes`` held-out task seeds, one episode each.

    ``collect_fn`` replaces ``agentrl.rollout.collect`` (a harness's rollouts).
    """
    from ..rollout import collect, summarize

    t = cfg.train
    ev = cfg.model_copy(deep=True)
    ev.rollout.group_size = 1
    ev.rollout.allocator, ev.rollout.budget = "independent", None
    if t.eval_temperature is not None:
        ev.sampling.temperature = t.eval_temperature
    ev.env.kwargs = {**ev.env.kwargs, **t.eval_env_kwargs}
    seeds = eval_seeds(t)
    t0 = time.perf_counter()
    trees = (collect_fn or collect)(ev.env.id, policy, ev, seeds, on_episode_done=on_episode_done)
    s = summarize(trees, time.perf_counter() - t0)
    return {"eval/success": s["success_rate"], "eval/reward": s["mean_reward"],
            "eval/turns": s["mean_turns"], "eval/failed": s["failed_episodes"],
            "time/eval_s": s["wall_s"], **_invalid(s, "eval")}


def _invalid(summary: dict, prefix: str) -> dict[str, float]:
    """``{prefix}/invalid_action_frac`` where the env reports invalid actions, else nothing."""
    frac = summary.get("invalid_action_frac")
    return {} if frac is None else {f"{prefix}/invalid_action_frac": frac}


# --------------------------------------------------------------------------- the loop


class _Bars:
    """Rich progress bars, one per phase, reset every step."""

    def __init__(self, console: Console, enabled: bool):
        self.progress = Progress("[progress.description]{task.description}", BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 disable=not enabled)
        self.tasks: dict[str, Any] = {}

    def start(self, phase: str, total: int, label: str = "") -> Callable[..., None]:
        desc = f"{phase:<8} {label}"
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(desc, total=total)
        else:
            self.progress.reset(self.tasks[phase], total=total, description=desc)
        task = self.tasks[phase]
        return lambda *_: self.progress.advance(task)

    def __enter__(self) -> _Bars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)


class RolloutSource(Protocol):
    """Where a step's trees come from when not from the native engine (an agent harness:
    ``agentrl.proxy.rollouts.HarnessRollouts``): ``collect`` has ``agentrl.rollout.collect``'s
    signature, ``stats`` are logged with each step, ``close`` ends it with the run."""

    stats: dict[str, Any]

    def collect(self, env_id: str, policy: Any, cfg: Any, seeds: list[int],
                on_episode_done: Callable[..., None] | None = None) -> list[RolloutTree]: ...

    def close(self) -> None: ...


class Trainer:
    """Holds the policy, the trained model, the optimizer and the run state; ``run()`` trains.

    ``rollouts(policy, cfg)``, when given, makes the step's rollout source
    (``RolloutSource``); by default the native engine rolls out.
    """

    def __init__(self, cfg: TrainRunConfig, policy: Any = None, console: Console | None = None,
                 progress: bool = True, rollouts: Callable[[Any, TrainRunConfig], RolloutSource] | None = None):
        from ..policy.for_run import policy_for_run

        t = cfg.train
        if t.harness is not None and rollouts is None:
            raise ConfigError("train.harness is set, but no harness rollout source was given: run it "
                              "with `agentrl train` (or pass rollouts=agentrl.proxy.harness_rollouts)")
        if t.distill is not None and t.distill.teacher in ("expert", "oracle"):  # the engine records its actions
            cfg = cfg.model_copy(deep=True)
            cfg.rollout.record_expert_actions = t.distill.teacher
        if t.value_head is not None:  # episodes cut at max_turns keep the next state, to bootstrap V from
            cfg = cfg.model_copy(deep=True)
            cfg.rollout.record_next_context = True
        self.cfg = cfg
        self.console = console or Console()
        self.progress = progress
        torch.manual_seed(t.seed)
        self.policy = policy if policy is not None else policy_for_run(cfg, trainable=True)
        net = getattr(self.policy, "model", None)
        if not isinstance(net, torch.nn.Module):
            raise ConfigError(f"policy.backend={cfg.policy.backend!r} holds no torch model to train; "
                              "use backend=hf")
        self.model = make_trainable(net, t)
        self.net = base_model(self.model)
        self.device = next(self.net.parameters()).device
        self.temperature = cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0
        tok = self.policy.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.ref = self._reference()
        self.score, self.minibatch = score_samples, None  # episode packing (batch.minibatch_step)
        if t.tree_packing:  # each tree's shared tokens once (tree_pack.py)
            from .tree_pack import score_samples_tree, tree_minibatch
            self.score, self.minibatch = score_samples_tree, tree_minibatch
        self.value_head = None  # credit: gae's V(s), a probe on the policy's features (value.py)
        if t.value_head is not None:
            from .value import ValueHead
            text = self.net.config.get_text_config() if hasattr(self.net.config, "get_text_config") else self.net.config
            self.value_head = ValueHead(text.hidden_size, t.value_head)
        self.distiller = None
        if t.distill is not None:
            from .distill import Distiller
            self.distiller = Distiller(t.distill, tok, self.device, t.steps, student=self.net,
                                       max_len=cfg.rollout.max_context_tokens + 2048)  # + a privileged prefix
        self.rollouts = rollouts(self.policy, cfg) if rollouts is not None else None
        self.optimizer = make_optimizer(self.model, t.lr, t)
        minibatches = math.ceil(t.tasks_per_step * cfg.rollout.group_size / t.minibatch_size)
        self.scheduler = make_scheduler(self.optimizer, t, t.steps * t.epochs * minibatches)
        self.step = 0
        self.sft_done = False
        self.phases: dict[str, float] = {}  # success rate at start, after SFT, at the end
        self.phase_rewards: dict[str, float] = {}  # mean reward of the same evaluations
        self.allocation: dict[str, Any] = {}  # what the allocator did, over the run's steps
        self.bars: _Bars | None = None
        self.producer: RolloutProducer | None = None  # train.asynchronous: the rollouts ahead
        self.out = Path(t.out_dir)
        self._owns_policy = policy is None  # close() closes only a policy it made

    def _reference(self) -> torch.nn.Module | None:
        """A frozen copy of the starting weights for the KL term (LoRA: the adapters switched off)."""
        if self.cfg.train.loss.kl_coef == 0 or self.model is not self.net:
            return None
        return copy.deepcopy(self.net).requires_grad_(False).eval()

    @contextlib.contextmanager
    def _ref_net(self) -> Iterator[torch.nn.Module]:
        if self.ref is not None:
            yield self.ref
        else:
            with self.model.disable_adapter():
                yield self.net

    # -- end -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the run holds, so the next run in this process starts from the same
        memory: the producer and its snapshot, the rollout source, the policy it made (rollout
        workers killed, an ``hf`` backend's thread and prefix cache freed), the teacher (a vLLM
        engine stopped), the env workers of its env, and every model and optimizer reference.
        Idempotent; the trainer is unusable after. A step that fails is warned about, and the
        rest still runs (``train`` calls this on the way out of an error too)."""
        owned = [("the rollout producer", self.producer), ("the rollout source", self.rollouts),
                 ("the policy", self.policy if self._owns_policy else None),
                 ("the distillation teacher", self.distiller)]
        for what, close in [(w, getattr(o, "close", None)) for w, o in owned] + [
                ("the env workers", self._shutdown_env_workers)]:
            try:
                if close is not None:
                    close()
            except Exception as e:  # noqa: BLE001 - closing the rest matters more than this one
                warnings.warn(f"closing {what} raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        self.producer = self.rollouts = self.distiller = self.ref = self.value_head = None
        self.policy = self.model = self.net = self.optimizer = self.scheduler = None  # type: ignore[assignment]

    def _shutdown_env_workers(self) -> None:
        if self.cfg.rollout.env_executor == "ray":
            from ..distributed.env_workers import shutdown_env_worker_pools

            shutdown_env_worker_pools(self.cfg.env.id)

    # -- state ---------------------------------------------------------------------------
    def save(self, export_hf: bool = False) -> Path:
        state = {"version": self.policy.version, "sft_done": self.sft_done, "phases": self.phases,
                 "phase_rewards": self.phase_rewards,
                 "config": self.cfg.model_dump(mode="json")}
        if self.value_head is not None:
            state["value_head"] = self.value_head.state()
        if self.distiller is not None and self.distiller.turn_mass:  # TurnOPD's depth statistics
            state["distill_turn_mass"] = self.distiller.turn_mass
        return save_checkpoint(self.out, self.step, self.model, self.optimizer, self.scheduler, state,
                               export_hf=export_hf, tokenizer=self.policy.tokenizer,
                               keep=self.cfg.train.keep_checkpoints)

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the newest checkpoint under ``out_dir`` (or ``path``); False when there is none."""
        path = path or latest_checkpoint(self.out)
        if path is None:
            return False
        ck = load_checkpoint(path)
        load_trainable(self.model, ck.trainable)
        if ck.optimizer is not None:
            self.optimizer.load_state_dict(ck.optimizer)
        if ck.scheduler is not None:
            self.scheduler.load_state_dict(ck.scheduler)
        if ck.rng is not None:
            restore_rng(ck.rng)
        self.step = ck.step
        self.sft_done = bool(ck.state.get("sft_done", False))
        self.phases = dict(ck.state.get("phases", {}))
        self.phase_rewards = dict(ck.state.get("phase_rewards", {}))
        if self.value_head is not None and "value_head" in ck.state:
            self.value_head.load(ck.state["value_head"])
        if self.distiller is not None and ck.state.get("distill_turn_mass"):
            self.distiller.set_turn_mass(ck.state["distill_turn_mass"])
        sync_policy(self.policy, self.model)  # drop keys and values of the weights before loading
        self.policy.version = int(ck.state.get("version", self.policy.version))
        return True

    # -- one step ----------------------------------------------------------------------------
    def rollout(self, step: int, bars: _Bars, policy: Any = None,
                max_turns: int | None = None) -> tuple[list[RolloutTree], dict[str, Any]]:
        """Step ``step``'s trees, sampled by ``policy`` (default: the trained model's own policy),
        at most ``max_turns`` turns an episode (TurnOPD's depth budget, ``_depth_budget``) if given.

        The asynchronous producer runs this in its thread: it reads no state the trainer
        changes meanwhile (the budget is handed over with each sync)."""
        from ..rollout import collect, summarize

        cfg = self.cfg.model_copy(deep=True)
        cfg.rollout.seed = request_seed(self.cfg.train.seed, step)  # fresh sampling streams per step
        if max_turns is not None:
            cfg.rollout.max_turns = min(cfg.rollout.max_turns, max_turns)
        seeds = step_task_seeds(self.cfg.train, step)
        advance = bars.start("rollout", len(seeds) * cfg.rollout.group_size, f"step {step + 1}")
        t0 = time.perf_counter()
        trees = (self.rollouts.collect if self.rollouts else collect)(
            cfg.env.id, self.policy if policy is None else policy, cfg, seeds, on_episode_done=advance)
        s = summarize(trees, time.perf_counter() - t0)
        extra = {**(self.rollouts.stats if self.rollouts else {}),
                 **getattr(self.policy, "stats", {})}  # rollout workers: deaths and retried requests
        return trees, {**extra, "rollout/success": s["success_rate"], "rollout/reward": s["mean_reward"],
                       "rollout/turns": s["mean_turns"], "rollout/episodes": s["episodes"],
                       "rollout/failed": s["failed_episodes"],
                       "rollout/action_tokens": s["action_tokens"], "time/rollout_s": s["wall_s"],
                       "rollout/env_steps": s["env_steps"],
                       "rollout/generated_tokens": s["generated_tokens"],
                       "data/first_task_seed": seeds[0], **_invalid(s, "rollout")}

    def _depth_budget(self) -> int | None:
        """The turn cap of the next rollouts: TurnOPD's depth budget, once it has a statistic."""
        return self.distiller.depth_budget if self.distiller is not None else None

    def _allocation(self, step: int, trees: list[RolloutTree]) -> dict[str, Any]:
        """The allocator's report into the run summary, and a warning when a tree allocator
        made no branch: its budget then went to fresh episodes, as ``independent`` would."""
        from ..rollout.allocators import ALLOCATORS

        name = self.cfg.rollout.allocator.name
        branches = sum(len(n.children) > 1 for t in trees for n in t.nodes.values())
        a = self.allocation
        a["allocator"], a["steps"] = name, a.get("steps", 0) + 1
        a["branch_points"] = a.get("branch_points", 0) + branches
        a["last_report"] = trees[0].meta.get("allocation_report", {}) if trees else {}
        if ALLOCATORS[name].needs_snapshots and branches == 0:  # a tree allocator: it branches
            a["steps_without_branch"] = a.get("steps_without_branch", 0) + 1
            self.console.print(
                f"[yellow]warning:[/] step {step + 1}: allocator {name!r} made no branch "
                f"(report: {a['last_report'].get(name, {})}): every leaf is a fresh episode. A branch "
                "needs a turn to branch before; on single-turn tasks set "
                "rollout.allocator.in_turn=true (key_state, entropy_branch) to fork inside a turn.",
                highlight=False)
        return {"rollout/branch_points": branches}

    def _no_signal(self, trees: list[RolloutTree], samples: list[Sample]) -> str | None:
        """Why this step has no policy-gradient signal, or None when it has one."""
        if self.distiller is not None:  # the teacher's advantages come later, in _score
            return None
        episodes = [ep for t in trees for ep in t.episodes()]
        if not episodes:
            return "the rollout produced no episode"
        if all(ep.error for ep in episodes):
            return f"all {len(episodes)} episodes failed (first: {episodes[0].error.splitlines()[0]})"
        if not samples:
            return ("every episode's advantages are zero (each group's episodes got the same reward), "
                    "and train.skip_zero_advantage left them all out; more episodes per group "
                    "(rollout.group_size) or a task the policy sometimes solves gives a signal")
        if all(a == 0.0 for x in samples for a, m in zip(x.advantages, x.mask, strict=True) if m):
            return ("every advantage is zero (each group's episodes got the same reward): only the KL "
                    "or entropy term trains")
        return None

    def _rl_loss(self, lp: torch.Tensor, ent: torch.Tensor, t: Row) -> tuple[torch.Tensor, dict]:
        v = t.values
        extra, d_stats = None, {}
        if "support_student" in v:  # distribution-level distillation: a per-token loss term
            from .distill import distribution_loss
            assert self.distiller is not None
            d = self.distiller.cfg
            extra, d_stats = distribution_loss(v["support_student"], v["support_teacher"], v["support"] >= 0,
                                               v["distill_weights"], t.mask, d.signal, d.jsd_beta)
        cfg, version = self.cfg.train.loss, self.policy.version
        # Kept tokens and the means' denominator are decided over the whole minibatch, not this row.
        masks = t.minibatch.token_masks(cfg, version, t) if t.minibatch is not None else None
        loss, stats = policy_loss(lp, v["advantages"], t.mask, cfg, old_logprobs=v.get("old"),
                                  behaviour_logprobs=v["behaviour"], versions=v["versions"],
                                  current_version=version, ref_logprobs=v.get("ref"),
                                  entropies=ent, seq_ids=t.seq_ids, extra_per_token=extra, masks=masks)
        return loss, {**stats, **d_stats}

    def needs_scoring_pass(self, n_samples: int) -> bool:
        """Whether old logprobs need their own no-grad pass before the update.

        With one optimizer step per batch (one epoch, one minibatch) the weights
        the update differentiates are the weights PPO's ratio anchors to, so the
        update's own logprobs, detached, are the old ones (ratio 1; TRL's GRPO
        skips the pass the same way when it makes one update per generation).
        A distillation teacher that reads ``Sample.old`` before the update
        keeps the pass.
        """
        t = self.cfg.train
        teacher_reads_old = self.distiller is not None and self.distiller.needs_student_scores
        return t.epochs > 1 or n_samples > t.minibatch_size or teacher_reads_old

    def _credit(self, trees: list[RolloutTree]) -> tuple[list[Sample], dict[str, Any]]:
        """Per-token advantages for every episode (and a refit value head), as samples."""
        from ..credit import assign

        t = self.cfg.train
        stats: dict[str, Any] = {}
        if t.credit == "none":
            from .distill import no_credit
            items = no_credit(trees)
        else:
            options = {"failed": self.cfg.rollout.failed_episodes, **t.credit_options}
            feats: dict[tuple[int, ...], tuple[torch.Tensor, Any]] = {}
            if self.value_head is not None:
                from .value import turn_features

                def value_fn(ep: Any) -> list[float]:
                    key = tuple(id(n) for n in ep.nodes)
                    if key not in feats:
                        feats[key] = (turn_features(self.net, ep), ep)
                    return self.value_head(feats[key][0]).tolist()

                options["value_fn"] = value_fn
            items = assign(trees, t.credit, **options)
            if t.credit == "gigpo":  # how often states recur: GiGPO's step level needs them
                from ..credit import anchor_group_stats
                stats.update(anchor_group_stats(trees, t.credit_options.get("similarity")))
            if self.value_head is not None and feats:  # refit V on this batch, after it was used
                stats.update(self.value_head.fit([f for f, _ in feats.values()], [e for _, e in feats.values()],
                                                 t.credit_options.get("gamma", 1.0), t.credit_options.get("lam", 1.0)))
        skip = (t.skip_zero_advantage and t.loss.kl_coef == 0 and t.loss.entropy_coef == 0
                and self.distiller is None)
        samples = samples_from_credit(items, skip_zero_advantage=skip)
        stats["adv/token_balance"] = advantage_balance([s.advantages for s in samples], [s.mask for s in samples])
        return samples, stats

    def _teacher_context(self, samples: list[Sample], trees: list[RolloutTree]) -> None:
        """What the distillation teacher reads of each sample's episode: its tree's privileged
        text (the env's, or a hindsight summary of the group), and the expert's action each turn."""
        from .distill import hindsight_summary

        assert self.distiller is not None
        tree_of = {id(n): tree for tree in trees for n in tree.nodes.values()}  # an episode's tree, by node
        hindsight = self.distiller.cfg.privileged_source == "hindsight"
        texts: dict[int, str | None] = {}
        for s in samples:
            ep = s.episode
            if ep is None or not ep.nodes:
                continue
            tree = tree_of[id(ep.nodes[0])]
            if id(tree) not in texts:  # one text per tree: the group of one task
                texts[id(tree)] = (hindsight_summary(tree, self.policy.tokenizer) if hindsight
                                   else tree.meta.get("privileged"))
            s.distill.privileged = texts[id(tree)]
            s.distill.expert_turns = [(a, b, n.expert_action, n.finish_reason in ("stop", "stop_string"))
                                      for (a, b), n in zip(ep.turn_spans, ep.nodes, strict=True)]

    def _score(self, samples: list[Sample], step: int, one_step: bool) -> tuple[tuple[str, ...], int, dict]:
        """The no-grad passes before the update: old (PPO's anchor), reference, teacher.

        Returns the row fields the loss reads, the tokens run, and stats.
        """
        t = self.cfg.train
        fields: tuple[str, ...] = ("advantages", "behaviour", "versions")
        tokens, stats = 0, {}
        if not one_step:
            top_k = self.distiller.top_k if self.distiller is not None else 0
            tokens = score_old(self.net, samples, t.micro_batch_tokens, self.pad_id, self.temperature,
                               top_k=top_k, score=self.score)
            fields += ("old",)
        if t.loss.kl_coef > 0:
            with self._ref_net() as ref:
                scores, n = score_samples(ref, samples, t.micro_batch_tokens, self.pad_id, self.temperature)
            for s, sc in zip(samples, scores, strict=True):
                s.ref = sc.logprobs
            tokens += n
            fields += ("ref",)
        if self.distiller is not None:  # the teacher scores the same tokens; A += w * A_distill
            # A privileged prefix lengthens the teacher's sequences past what one forward pass was sized for.
            room = max(t.micro_batch_tokens, max(len(x.input_ids) for x in samples))

            def teacher_score(net: torch.nn.Module, ss: list[Sample], temp: float, **kw: Any) -> Any:
                return self.score(net, ss, max(room, max(len(x.input_ids) for x in ss)), self.pad_id, temp, **kw)

            stats.update(self.distiller.apply(samples, step, teacher_score))
            tokens += stats.get("distill/teacher_tokens", 0)
            if self.distiller.distribution:
                fields += ("support", "support_teacher", "distill_weights")
        return fields, tokens, stats

    def learn(self, trees: list[RolloutTree], step: int, bars: _Bars) -> dict[str, Any]:
        """Credit, scoring passes and the update on one rollout batch, at ``train.precision``."""
        with precision(self.cfg.train.precision):
            return self._learn(trees, step, bars)

    def _learn(self, trees: list[RolloutTree], step: int, bars: _Bars) -> dict[str, Any]:
        t = self.cfg.train
        t0 = time.perf_counter()
        samples, stats = self._credit(trees)
        why = self._no_signal(trees, samples)
        stats["train/no_signal"] = int(why is not None)
        if why is not None:
            self.console.print(f"[yellow]warning:[/] step {step + 1}: no learning signal: {why}",
                               highlight=False)
        if self.distiller is not None:
            self._teacher_context(samples, trees)
        stats["train/episodes"] = len(samples)
        stats["time/credit_s"] = time.perf_counter() - t0
        if not samples:
            return stats
        t0 = time.perf_counter()
        labels: list[Sample] = []  # DAgger: the expert's actions in the student's states, as extra samples
        if self.distiller is not None and self.distiller.labels:
            labels, label_stats = self.distiller.expert_labels(samples, step, self.policy.version)
            stats.update(label_stats)
        batch = samples + labels
        one_step = not self.needs_scoring_pass(len(batch)) and not labels
        fields, tokens, score_stats = self._score(batch, step, one_step)
        for lab in labels:  # never sampled: its old logprobs stand for the behaviour, no mismatch to correct
            lab.behaviour = list(lab.old or lab.behaviour)
        stats.update(score_stats)
        stats["time/old_logprobs_s"] = time.perf_counter() - t0
        stats["train/scoring_pass"] = int(not one_step)
        n_mb = t.epochs * math.ceil(len(batch) / t.minibatch_size)
        advance = bars.start("train", n_mb, f"step {step + 1}")
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(request_seed(t.seed, step, 1))
        st = train_on_samples(self.model, self.optimizer, self.scheduler, batch, self._rl_loss,
                              fields=fields, epochs=t.epochs, minibatch_size=t.minibatch_size,
                              max_tokens=t.micro_batch_tokens, max_grad_norm=t.max_grad_norm,
                              per_token=t.loss.agg == "token-mean", pad_id=self.pad_id,
                              temperature=self.temperature, generator=gen, on_minibatch=advance,
                              minibatch=self.minibatch)
        wall = time.perf_counter() - t0
        stats.update(st)
        if one_step:  # the loss compared its own detached logprobs with the behaviour ones
            stats["mismatch/kl"] = st.get("mismatch/mismatch_kl", 0.0)
        else:
            flat = lambda get: torch.tensor([x for s in samples for x in get(s)])  # noqa: E731
            mm = mismatch_stats(flat(lambda s: s.old), flat(lambda s: s.behaviour), flat(lambda s: s.mask).bool())
            stats["mismatch/kl"], stats["mismatch/max_abs_dlogprob"] = mm["mismatch_kl"], mm["max_abs_dlogprob"]
        stats["time/train_s"] = wall
        stats["train/tokens_per_s"] = (st["train/tokens"] + tokens) / max(wall + stats["time/old_logprobs_s"], 1e-9)
        stats["train/lr"] = self.scheduler.get_last_lr()[0]
        return stats

    # -- the run -------------------------------------------------------------------------------
    def _eval(self, label: str, bars: _Bars) -> dict[str, Any]:
        n = len(eval_seeds(self.cfg.train))
        if n == 0:
            return {}
        advance = bars.start("eval", n, label)
        return evaluate(self.policy, self.cfg, on_episode_done=advance,
                        collect_fn=self.rollouts.collect if self.rollouts else None)

    def _phase(self, name: str, ev: dict[str, Any]) -> None:
        if "eval/success" in ev:
            self.phases[name] = ev["eval/success"]
            self.phase_rewards[name] = ev["eval/reward"]
            self.console.print(f"[bold]{name}[/]: held-out success {ev['eval/success']:.3f} "
                               f"({len(eval_seeds(self.cfg.train))} episodes), "
                               f"reward {ev['eval/reward']:.3f}")

    def run(self, sft: Callable[[Trainer], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Train to ``train.steps``; ``sft`` (the warm start) runs first unless already done."""
        t = self.cfg.train
        resumed = bool(self.step or self.phases)
        log = MetricsLogger(self.out, tensorboard=t.tensorboard,
                            resume_step=self.step if resumed else -1)
        mem = PeakMemory()  # each logged row carries its phase's (or step's) peak memory
        try:
            with _Bars(self.console, self.progress) as bars:
                self.bars = bars
                if "start" not in self.phases and t.eval_start:
                    mem.start()
                    ev = self._eval("start", bars)
                    self._phase("start", ev)
                    log.log(0, {"phase": "start", **ev, **mem.read()})
                if sft is not None and not self.sft_done:
                    mem.start()
                    st = sft(self)
                    self.sft_done = True
                    ev = self._eval("after SFT", bars)
                    self._phase("after_sft", ev)
                    log.log(0, {"phase": "sft", **st, **ev, **mem.read()})
                    self.save()
                overall = bars.start("steps", t.steps)
                for _ in range(self.step):
                    overall()
                ran = self.step < t.steps
                a = t.asynchronous
                if ran and a is not None:  # a fresh snapshot of the weights SFT or a resume left
                    sampler = (self.policy.sampler() if hasattr(self.policy, "sampler")  # rollout workers
                               else SnapshotPolicy.of(self.policy))
                    self.producer = RolloutProducer(
                        lambda k, policy, max_turns: self.rollout(k, bars, policy, max_turns), sampler,
                        self.step, t.steps, a.max_batch_staleness, a.queue_size, a.batch_timeout_s,
                        max_turns=self._depth_budget()).begin()
                while self.step < t.steps:
                    mem.start()
                    row = self._one_step(bars)
                    log.log(self.step, {"phase": "rl", **row, **mem.read()})
                    overall()
                ev = {}
                mem.start()
                if not ran and "after_sft" in self.phases:  # nothing changed since that eval
                    self.phases.setdefault("end", self.phases["after_sft"])
                    if "after_sft" in self.phase_rewards:
                        self.phase_rewards.setdefault("end", self.phase_rewards["after_sft"])
                elif ran or "end" not in self.phases:
                    ev = self._eval("end", bars)
                    self._phase("end", ev)
            t0 = time.perf_counter()
            final = self.save(export_hf=t.export_hf)
            log.log(self.step, {"phase": "end", **ev, "time/checkpoint_s": time.perf_counter() - t0,
                                **mem.read()})
        finally:
            self.bars = None
            if self.producer is not None:
                self.producer.close()
                self.producer = None
            if self.rollouts is not None:
                self.rollouts.close()
            log.close()
        png = None
        if t.plot:
            png = plot_learning_curve(log.path, self.out / "learning_curve.png",
                                      title=f"{self.cfg.env.id} / {self.cfg.policy.model}")
        return {"phases": dict(self.phases), "phase_rewards": dict(self.phase_rewards),
                "allocation": dict(self.allocation), "checkpoint": str(final),
                "learning_curve": str(png) if png else None, "metrics": str(log.path)}

    def _save_trees(self, step: int, trees: list[RolloutTree]) -> None:
        """The step's first ``train.save_trees`` trees, as the viewer and ``agentrl tree`` read them."""
        n = self.cfg.train.save_trees
        if n == 0:
            return
        folder = self.out / "trees"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{step:06d}.jsonl"
        tmp = folder / f".{path.name}.tmp"
        write_trees(tmp, trees[:n])
        tmp.replace(path)  # a resumed run redoes the step: the file is replaced whole

    def _one_step(self, bars: _Bars) -> dict[str, Any]:
        t, k = self.cfg.train, self.step
        t_step = time.perf_counter()
        if self.producer is None:
            trees, stats = self.rollout(k, bars, max_turns=self._depth_budget())
            data_step = k
        else:
            batch, stats = self.producer.take(self.policy.version)
            trees, stats, data_step = batch.trees, {**batch.stats, **stats}, batch.step
        stats.update(self._allocation(data_step, trees))  # here, not in the producer's thread
        self._save_trees(k + 1, trees)
        stats.update(self.learn(trees, k, bars))
        t0 = time.perf_counter()
        sync_policy(self.policy, self.model)
        if self.producer is not None:
            self.producer.synced(self.net, self.policy.version, max_turns=self._depth_budget())
        stats["time/sync_s"] = time.perf_counter() - t0
        stats["policy/version"] = self.policy.version
        self.step = k + 1
        if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
            stats.update(self._eval(f"step {self.step}", bars))
        if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.steps:
            t0 = time.perf_counter()
            self.save()
            stats["time/checkpoint_s"] = time.perf_counter() - t0
        stats["time/step_s"] = time.perf_counter() - t_step  # the whole step, eval and checkpoint included
        return stats


def train(cfg: TrainRunConfig, *, resume: bool = False, overwrite: bool = False, policy: Any = None,
          progress: bool = True, console: Console | None = None,
          rollouts: Callable[[Any, TrainRunConfig], RolloutSource] | None = None) -> dict[str, Any]:
    """Run ``agentrl train``: optional SFT warm start, then the RL loop; returns a summary.

    ``resume`` continues from the newest checkpoint in ``train.out_dir``. A
    fresh run refuses an ``out_dir`` that holds checkpoints unless ``overwrite``,
    which removes the old run's checkpoints, TensorBoard events and saved trees.
    ``train.steps=0`` without SFT is a dry run: the model and the rollout source
    are made, the plan printed, and nothing is evaluated or written.
    ``rollouts`` makes a rollout source other than the native engine (see ``Trainer``).
    """
    from .sft import sft_phase

    out = Path(cfg.train.out_dir)
    warm = sft_phase if cfg.sft.episodes > 0 or cfg.sft.task_seeds else None
    dry = cfg.train.steps == 0 and warm is None
    if not dry and not resume and latest_checkpoint(out) is not None:
        if not overwrite:
            raise ConfigError(f"train.out_dir={out} already holds checkpoints: pass --resume to "
                              "continue that run, or --overwrite to start over")
        for old in ("checkpoints", "tensorboard", "trees"):  # else TensorBoard and the viewer mix two runs
            shutil.rmtree(out / old, ignore_errors=True)
    trainer = Trainer(cfg, policy=policy, console=console, progress=progress, rollouts=rollouts)
    try:
        if dry:
            plan = run_plan(cfg)
            print_plan(trainer.console, plan)
            return {"dry_run": True, "plan": plan, "phases": {}, "checkpoint": None, "metrics": None,
                    "learning_curve": None}
        if resume and trainer.resume():
            trainer.console.print(f"resumed from step {trainer.step} ({out / 'checkpoints'})")
        return trainer.run(sft=warm)
    finally:
        trainer.close()
        del trainer
        # What the run left in reference cycles (frames of exceptions caught inside libraries,
        # progress bars) would otherwise wait for a full collection, holding models and caches.
        gc.collect()
