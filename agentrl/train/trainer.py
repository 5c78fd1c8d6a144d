"""One job: the run around the learning step: phases, rollouts, evaluation, checkpoints, progress.

One step of ``Trainer.run`` (step k trains on the task seeds of step k, so the
step *is* the data position and a resumed run sees the same data):

1. **rollout**: a collect function (``agentrl.rollout.collect``, or a
   harness's) grows one tree per task seed, ``rollout.group_size`` episodes
   each, under the policy's current weights;
2. **learn**: ``step.Learner.learn``: credit, the scoring passes, distillation's
   advantage term and the optimizer steps (listed in ``agentrl.train.step``);
3. **sync**: the policy gets the new weights (``model.sync_policy``);
4. **eval** on held-out task seeds every ``evaluation.every`` steps
   (``agentrl.evaluation``), and **checkpoint** every ``checkpointing.every`` steps.

With ``train.asynchronous`` the rollouts of the next steps run in a producer
thread, from a copy of the weights (a snapshot in this process, or the
rollout workers' own), while this step trains (``agentrl.train.asynchronous``);
step 1 then takes its trees from that queue and step 5 also refreshes the copy.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..env import check_env_kwargs
from ..errors import ConfigError, RolloutError
from ..evaluation import evaluate_held_out, held_out_seeds
from ..heap import give_back_freed_memory
from ..policy.snapshot import SnapshotPolicy
from ..precision import sampler_precision
from ..types import RolloutTree
from .asynchronous import RolloutProducer, workers_gone
from .checkpoint import (
    checkpoint_dirs,
    config_changes,
    latest_checkpoint,
    load_checkpoint,
    load_trainable,
    prune_checkpoints,
    restore_rng,
    save_checkpoint,
)
from .compiled import compile_resolves_on
from .config import TrainRunConfig
from .curriculum import check_held_out, check_levels
from .metrics import MetricsLogger, PeakMemory, ProgressBars, plot_learning_curve, read_metrics
from .model import precision, precision_note, resolved_precision, sync_policy
from .output_lock import output_lock
from .plan import print_plan, run_plan, step_task_seeds
from .rollouts import RolloutSource, allocation_report, drop_trees_after, save_trees, step_rollouts
from .step import Learner, StartBar

__all__ = [
    "Trainer",
    "resolve_old_logprobs",
    "run_plan",
    "step_task_seeds",
    "train",
]

def resolve_old_logprobs(cfg: TrainRunConfig, policy: Any = None) -> tuple[TrainRunConfig, str | None]:
    """``train.old_logprobs`` as this machine runs it: ``auto`` becomes ``sampler`` where the
    sampler computes what the trainer does (the hf backend, fp32 training, nothing in
    ``sampler_anchor_refusal``, and ``policy``, where one is handed to the trainer, an fp32
    ``HFPolicy``), else ``rescore``; a ``sampler`` that cannot be is refused.
    Returns the config (a copy where auto was resolved) and a line saying what auto chose."""
    from ..policy.registry import resolve_backend

    t = cfg.train
    backend, precision = resolve_backend(cfg.policy.backend)[0], resolved_precision(t.precision, cfg.policy.device)
    why = None
    if backend != "hf" or precision != "fp32":
        why = (f"policy.backend resolving to {backend!r} and train.precision={t.precision!r} to {precision!r}: "
               "the sampler must compute what the trainer does, the hf backend in fp32")
    why = why or cfg.sampler_anchor_refusal()
    if why is None and policy is not None and (other := _not_an_fp32_hf_sampler(policy)):
        why = f"the policy given to the trainer {other}"
    if t.old_logprobs == "sampler":
        if why is not None:
            raise ConfigError(f"train.old_logprobs=sampler anchors PPO to the sampler's log-probs, which must be "
                              f"the trainer's; here they are not, because of {why}; use rescore or auto")
        return cfg, None
    cfg = cfg.model_copy(deep=True)
    cfg.train.old_logprobs = "rescore" if why is not None else "sampler"
    note = ("train.old_logprobs auto: sampler (PPO anchors to the sampler's log-probs; no scoring pass)"
            if why is None else f"train.old_logprobs auto: rescore, because of {why}")
    return cfg, note


def _not_an_fp32_hf_sampler(policy: Any) -> str | None:
    """Why a policy handed to ``Trainer`` samples with other numbers than an fp32 update computes
    (``resolve_old_logprobs`` reads the config, which such a policy need not follow); None where
    not, or where it cannot tell: a policy from elsewhere (Ray's rollout workers, a wrapper) is
    taken to be what the config says, which the config's own checks cover."""
    from ..policy.hf import HFPolicy

    if isinstance(policy, HFPolicy):
        dtypes = {p.dtype for p in policy.model.parameters() if p.is_floating_point()}
        if not dtypes <= {torch.float32}:
            return f"samples in {sorted(map(str, dtypes))}, not float32"
        return None if policy.precision == "fp32" else f"samples in {policy.precision} (its precision), not fp32"
    if type(policy).__module__.startswith("agentrl.policy."):  # vllm, openai, mock: another sampler
        return f"is a {type(policy).__name__}, not the hf backend"
    return None


def _pinned_models(cfg: TrainRunConfig) -> TrainRunConfig:
    """``cfg`` with a run or checkpoint folder as ``policy.model`` or distillation teacher
    resolved once to the export it means now (``agentrl.models.exact_model``): the learner,
    the samplers and a resumed run then all load that one, and the saved config records it,
    though the source run may export a newer checkpoint later."""
    from ..models import exact_model

    d = cfg.train.distill
    teacher = d.teacher if d is not None and d.teacher not in ("expert", "oracle") and ":" not in d.teacher else None
    model, pinned_teacher = exact_model(cfg.policy.model), teacher and exact_model(teacher)
    if model == cfg.policy.model and pinned_teacher == teacher:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.policy.model = model
    if pinned_teacher:
        cfg.train.distill.teacher = pinned_teacher  # type: ignore[union-attr]
    return cfg


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
        cfg = _pinned_models(cfg)
        levels = {"train.curriculum": t.curriculum, "sft.levels": cfg.sft.levels}
        for key, kwargs in (("env.kwargs", cfg.env.kwargs), ("train.evaluation.env_kwargs", t.evaluation.env_kwargs)):
            check_env_kwargs(cfg.env.id, kwargs, key, cfg.env.imports)  # else every episode fails making its env
        check_levels(cfg.env.id, cfg.env.imports, levels)
        check_held_out(cfg.env.kwargs, t.evaluation.env_kwargs, levels, cfg.env.id, cfg.env.imports)
        with contextlib.suppress(RuntimeError):  # an unknown device: loading the policy says so
            resolved_precision(t.precision, cfg.policy.device)  # a bad AGENTRL_CPU_BF16 fails now, not mid-run
        if cfg.policy.precision == "auto":  # the hf sampler computes what the update does
            with contextlib.suppress(RuntimeError):
                cfg = cfg.model_copy(deep=True)
                cfg.policy.precision = sampler_precision("auto", cfg.policy.device, t.precision)  # type: ignore[assignment]
        anchor_note = None
        if t.old_logprobs in ("sampler", "auto"):  # what auto resolves to on this machine (config checks the rest)
            cfg, anchor_note = resolve_old_logprobs(cfg, policy)
            t = cfg.train
        self.cfg = cfg
        self.console = console or Console()
        self.progress = progress
        torch.manual_seed(t.seed)
        self.step = 0
        self.sft_done = False
        self._saved_row: dict[str, Any] | None = None  # the row the resumed checkpoint was saved with
        self.phases: dict[str, float] = {}  # success rate at start, after SFT, at the end
        self.phase_rewards: dict[str, float] = {}  # mean reward of the same evaluations
        self.allocation: dict[str, Any] = {}  # what the allocator did, over the run's steps
        self.out = Path(t.output.dir)
        self.producer: RolloutProducer | None = None  # train.asynchronous: the rollouts ahead
        self.rollouts = self.learner = None  # type: ignore[assignment]
        self._owns_policy = policy is None  # close() closes only a policy it made
        self.policy = policy if policy is not None else policy_for_run(cfg, trainable=True)
        try:  # what fails from here (a teacher that will not load) must not leave the policy running
            self.learner = Learner(cfg, self.policy, self.console)  # the model, its optimizer, what scores
            if note := precision_note(t.precision, next(self.learner.model.parameters()).device):
                self.console.print(f"[yellow]warning:[/] {note}")
            if anchor_note is not None:
                self.console.print(f"[dim]{anchor_note}[/]", highlight=False)
            if t.compile == "auto":
                device = next(self.learner.model.parameters()).device
                with precision(t.precision):
                    if compile_resolves_on(t.compile, device):
                        self.console.print("[dim]train.compile auto: the decoder layers run compiled in the training "
                                           "passes (bf16 on this CPU); each new kind of pass compiles first, "
                                           "about 10 s[/]", highlight=False)
            self.rollouts = rollouts(self.policy, cfg) if rollouts is not None else None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release what the run holds, so the next run in this process starts from the same
        memory: the producer and its snapshot, the rollout source, the policy it made (rollout
        workers killed, an ``hf`` backend's thread and prefix cache freed), the teacher (a vLLM
        engine stopped), the env workers of its env, and every model and optimizer reference.
        Idempotent; the trainer is unusable after. A step that fails is warned about, and the
        rest still runs (``train`` calls this on the way out of an error too)."""
        owned = [("the rollout producer", self.producer), ("the rollout source", self.rollouts),
                 ("the policy", self.policy if self._owns_policy else None),
                 ("the learning step (its teacher)", self.learner)]
        for what, close in [(w, getattr(o, "close", None)) for w, o in owned] + [
                ("the env workers", self._shutdown_env_workers)]:
            try:
                if close is not None:
                    close()
            except Exception as e:  # noqa: BLE001 - closing the rest matters more than this one
                warnings.warn(f"closing {what} raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        self.producer = self.rollouts = self.learner = self.policy = None  # type: ignore[assignment]

    def _shutdown_env_workers(self) -> None:
        if self.cfg.rollout.env_executor == "ray":
            from ..distributed.env_workers import shutdown_env_worker_pools

            shutdown_env_worker_pools(self.cfg.env.id)

    # -- state ---------------------------------------------------------------------------
    def save(self, export_hf: bool = False, prune: bool = True, row: dict[str, Any] | None = None) -> Path:
        """Checkpoint the run; ``row`` is the metrics row logged right after, kept so that a
        resume can log it if the run was killed between the save and the row."""
        state = {"version": self.policy.version, "sft_done": self.sft_done, "phases": self.phases,
                 "phase_rewards": self.phase_rewards,
                 "config": self.cfg.model_dump(mode="json")}
        if row is not None:  # as its metrics line holds it (state.json writes other values as str)
            state["row"] = json.loads(json.dumps(row, default=float))
        lr = self.learner
        if lr.value_head is not None:
            state["value_head"] = lr.value_head.state()
        if lr.distiller is not None and lr.distiller.turn_mass:  # TurnOPD's depth statistics
            state["distill_turn_mass"] = lr.distiller.turn_mass
        return save_checkpoint(self.out, self.step, lr.model, lr.optimizer, lr.scheduler, state,
                               export_hf=export_hf, tokenizer=self.policy.tokenizer,
                               keep=self.cfg.train.checkpointing.keep if prune else None)

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the newest checkpoint under ``train.output.dir`` (or ``path``); False when there is none."""
        path = path or latest_checkpoint(self.out)
        if path is None:
            return False
        try:
            ck, lr = load_checkpoint(path), self.learner
        except Exception as e:  # a file missing or cut short (saves are atomic: a disk's or a hand's doing)
            dirs = checkpoint_dirs(self.out)
            before = dirs[dirs.index(Path(path)) - 1] if Path(path) in dirs[1:] else None
            hint = (f"remove that folder to resume from the checkpoint before it ({before.name})" if before
                    else "start over with --overwrite")
            raise ConfigError(f"cannot resume from {path}: {type(e).__name__}: {e}; {hint}") from None
        was = (ck.state.get("config") or {}).get("policy", {}).get("model")
        if was is not None and was != self.cfg.policy.model:  # weights it did not train come from the new one
            self.console.print(f"[yellow]warning:[/] resume: the checkpoint's run started from policy.model={was}; "
                               f"this run loaded {self.cfg.policy.model}, and the weights the checkpoint does "
                               "not hold (all but the trained ones) are that model's", highlight=False)
        changed = config_changes(ck.state.get("config") or {}, self.cfg.model_dump(mode="json"))
        said = ("policy.model", "train.optimizer.lr")  # each said on its own, with what it means
        if told := [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in said]:
            self.console.print(f"resume: this run's config differs from the checkpoint's: {'; '.join(told)}",
                               highlight=False)
        try:
            load_trainable(lr.model, ck.trainable)
            if ck.optimizer is not None:  # fewer trainable parameters load, but their moments do not
                lr.optimizer.load_state_dict(ck.optimizer)
        except ValueError as e:  # another trainable setting: name the key, not the tensors
            raise ConfigError(f"{_unfit_key(changed, path)}; {e}: resume with the checkpoint's settings, "
                              "or start over with --overwrite") from None
        if ck.scheduler is not None:
            lr.scheduler.load_state_dict(ck.scheduler)
        self._keep_config_lr()
        self._keep_config_adamw()
        if ck.rng is not None:
            restore_rng(ck.rng)
        self.step = ck.step
        self.sft_done = bool(ck.state.get("sft_done", False))
        self.phases = dict(ck.state.get("phases", {}))
        self.phase_rewards = dict(ck.state.get("phase_rewards", {}))
        self._saved_row = ck.state.get("row")
        if lr.value_head is not None and "value_head" in ck.state:
            lr.value_head.load(ck.state["value_head"])
        if lr.distiller is not None and ck.state.get("distill_turn_mass"):
            lr.distiller.set_turn_mass(ck.state["distill_turn_mass"])
        sync_policy(self.policy, lr.model)  # drop keys and values of the weights before loading
        self.policy.version = int(ck.state.get("version", self.policy.version))
        return True

    def _keep_config_lr(self) -> None:
        """After a resume: the config's ``train.optimizer.lr``, not the checkpoint's, where they
        differ (a run continued with a new rate), with the schedule's position kept; said on the
        console. The optimizer's state otherwise continues as saved."""
        lr, want = self.learner, self.cfg.train.optimizer.lr
        groups = lr.optimizer.param_groups
        had = groups[0].get("initial_lr", groups[0]["lr"])
        if had == want:
            return
        lr.scheduler.base_lrs = [want] * len(groups)
        for group, factor in zip(groups, lr.scheduler.lr_lambdas, strict=True):
            group["initial_lr"], group["lr"] = want, want * factor(lr.scheduler.last_epoch)
        lr.scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr() (train/lr) reports
        self.console.print(f"resume: the checkpoint trained at lr {had:g}; this run continues at "
                           f"train.optimizer.lr={want:g}")

    def _keep_config_adamw(self) -> None:
        """After a resume: the config's ``train.optimizer.weight_decay`` and ``betas``, not the
        checkpoint's (``load_state_dict`` brings the saved ones back with the moments), where they
        differ; said on the console. The moments themselves continue as saved."""
        o, groups = self.cfg.train.optimizer, self.learner.optimizer.param_groups
        want = {"weight_decay": float(o.weight_decay), "betas": tuple(float(b) for b in o.betas)}
        had = {"weight_decay": groups[0]["weight_decay"], "betas": tuple(groups[0]["betas"])}
        if had == want:
            return
        for group in groups:
            group.update(want)
        said = "; ".join(f"{k} {had[k]} -> {want[k]}" for k in want if had[k] != want[k])
        self.console.print(f"resume: AdamW continues with this run's train.optimizer: {said}", highlight=False)

    # -- one step ----------------------------------------------------------------------------
    def rollout(self, step: int, bars: ProgressBars, policy: Any = None,
                max_turns: int | None = None) -> tuple[list[RolloutTree], dict[str, Any]]:
        """Step ``step``'s trees, sampled by ``policy`` (default: the trained model's own policy),
        at most ``max_turns`` turns an episode (TurnOPD's depth budget, ``_depth_budget``) if given.

        The asynchronous producer runs this in its thread: it reads no state the trainer
        changes meanwhile (the budget is handed over with each sync)."""
        extra = {**(self.rollouts.stats if self.rollouts else {}),
                 **getattr(self.policy, "stats", {})}  # rollout workers: deaths and retried requests
        return step_rollouts(self.cfg, step, self.policy if policy is None else policy,
                             lambda total, label: bars.start("rollout", total, label), self.rollouts,
                             max_turns, extra)

    def _depth_budget(self) -> int | None:
        """The turn cap of the next rollouts: TurnOPD's depth budget, once it has a statistic."""
        distiller = self.learner.distiller
        return distiller.depth_budget if distiller is not None else None

    def _eval(self, label: str, bars: ProgressBars) -> dict[str, Any]:
        ev = self.cfg.train.evaluation
        n = len(held_out_seeds(ev))
        if n == 0:
            return {}
        advance = bars.start("eval", n, label)
        return evaluate_held_out(self.policy, self.cfg, ev, on_episode_done=advance,
                                 collect_fn=self.rollouts.collect if self.rollouts else None)

    def _phase(self, name: str, ev: dict[str, Any]) -> None:
        if "eval/success" in ev:
            self.phases[name] = ev["eval/success"]
            self.phase_rewards[name] = ev["eval/reward"]
            self.console.print(f"[bold]{name}[/]: held-out success {ev['eval/success']:.3f} "
                               f"({len(held_out_seeds(self.cfg.train.evaluation))} episodes), "
                               f"reward {ev['eval/reward']:.3f}")

    def run(self, sft: Callable[[Learner, StartBar], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Train to ``train.steps``; ``sft`` (the warm start) runs first unless already done."""
        t = self.cfg.train
        resumed = bool(self.step or self.phases or self.sft_done)  # evaluation off records no phase
        log = MetricsLogger(self.out, tensorboard=t.output.tensorboard,
                            resume_step=self.step if resumed else -1)
        drop_trees_after(self.out, self.step if resumed else 0)  # as the rows of those steps went
        if resumed and self._saved_row is not None:
            self._log_lost_row(log, self._saved_row)
        mem = PeakMemory()  # each logged row carries its phase's (or step's) peak memory

        def phase() -> None:  # a phase starts from what it holds: what the last one freed goes back
            give_back_freed_memory()
            mem.start()

        try:
            with ProgressBars(self.console, self.progress) as bars:
                if not resumed and t.evaluation.start:  # a resumed model is no longer the base model
                    phase()
                    ev = self._eval("start", bars)
                    self._phase("start", ev)
                    log.log(0, {"phase": "start", **ev, **mem.read()})
                if sft is not None and not self.sft_done:
                    phase()
                    st = sft(self.learner, bars.start)
                    self.sft_done = True
                    ev = self._eval("after SFT", bars)
                    self._phase("after_sft", ev)
                    self._save_then_log(log, mem, {"phase": "sft", **st, **ev})
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
                    phase()
                    row = {"phase": "rl", **self._one_step(bars)}
                    every = t.checkpointing.every
                    if every and self.step % every == 0 and self.step < t.steps:
                        self._save_then_log(log, mem, row)
                    else:
                        log.log(self.step, {**row, **mem.read()})
                    overall()
                ev = {}
                phase()
                if not ran and "after_sft" in self.phases:  # nothing changed since that eval
                    self.phases.setdefault("end", self.phases["after_sft"])
                    if "after_sft" in self.phase_rewards:
                        self.phase_rewards.setdefault("end", self.phase_rewards["after_sft"])
                elif ran or "end" not in self.phases:
                    ev = self._eval("end", bars)
                    self._phase("end", ev)
            final = self._save_then_log(log, mem, {"phase": "end", **ev}, export_hf=t.checkpointing.export_hf)
        finally:  # producer, rollouts, log: each closes whatever the one before raised
            with contextlib.ExitStack() as closing:
                closing.callback(log.close)
                if self.rollouts is not None:
                    closing.callback(self.rollouts.close)
                if self.producer is not None:
                    closing.callback(self.producer.close)
                    self.producer = None
        png = None
        if t.output.plot:
            png = plot_learning_curve(log.path, self.out / "learning_curve.png",
                                      title=f"{self.cfg.env.id} / {self.cfg.policy.model}")
        return {"phases": dict(self.phases), "phase_rewards": dict(self.phase_rewards),
                "allocation": dict(self.allocation), "checkpoint": str(final),
                "learning_curve": str(png) if png else None, "metrics": str(log.path)}

    def _one_step(self, bars: ProgressBars) -> dict[str, Any]:
        t, k = self.cfg.train, self.step
        t_step = time.perf_counter()
        if self.producer is None:
            trees, stats = self.rollout(k, bars, max_turns=self._depth_budget())
            if why := workers_gone(self.policy):  # each step after would fail every episode too
                raise RolloutError(f"{why}: no episode can run, so the run stops")
            data_step = k
        else:
            batch, stats = self.producer.take(self.policy.version)
            trees, stats, data_step = batch.trees, {**batch.stats, **stats}, batch.step
        # here, not in the producer's thread
        stats.update(allocation_report(self.cfg.rollout.allocator.name, self.allocation, data_step, trees, self.console))
        try:
            stats.update(self.learner.learn(trees, k, bars.start))
        finally:  # after the update: with the values it used; a failed update's trees too
            save_trees(self.out, t.output.save_trees, k + 1, trees)
        t0 = time.perf_counter()
        if stats.get("train/optimizer_steps", 0):  # no sample, no step: same weights, same version
            sync_policy(self.policy, self.learner.model)
        if self.producer is not None:
            self.producer.synced(self.learner.net, self.policy.version, max_turns=self._depth_budget())
        stats["time/sync_s"] = time.perf_counter() - t0
        stats["policy/version"] = self.policy.version
        self.step = k + 1
        every = t.evaluation.every
        if every and self.step % every == 0 and self.step < t.steps:
            stats.update(self._eval(f"step {self.step}", bars))
        stats["time/step_s"] = time.perf_counter() - t_step  # the whole step, eval included; run() adds a checkpoint
        return stats

    def _log_lost_row(self, log: MetricsLogger, row: dict[str, Any]) -> None:
        """Log the resumed checkpoint's row where ``metrics.jsonl`` lacks it: the run was killed
        after the save and before the row (without the save's seconds and peak memory, which
        were measured after it)."""
        phase = row.get("phase")
        if not any(r.get("step") == self.step and r.get("phase") == phase for r in read_metrics(log.path)):
            log.log(self.step, {**row, "recovered_from_checkpoint": True})

    def _save_then_log(self, log: MetricsLogger, mem: PeakMemory, row: dict[str, Any],
                       export_hf: bool = False) -> Path:
        """Checkpoint, then log ``row`` with the save's seconds (added to a step's ``time/step_s``)
        and the peak memory, the save's included.

        A save that fails (a full disk, an interrupt) still logs ``row``, with the error, before raising:
        the step's metrics and evaluation are measured, and the failed save must not take them along.
        Old checkpoints are pruned after the row (their seconds are in neither): an interrupt there
        leaves a whole checkpoint and a row without an error.
        """
        t0 = time.perf_counter()
        try:
            path = self.save(export_hf=export_hf, prune=False, row=row)
        except BaseException as e:
            with contextlib.suppress(Exception):  # a full disk may refuse the row too: the save's error goes up
                log.log(self.step, {**row, **mem.read(), "checkpoint/error": f"{type(e).__name__}: {e}"})
            raise
        dt = time.perf_counter() - t0
        if "time/step_s" in row:
            row = {**row, "time/step_s": row["time/step_s"] + dt}
        try:
            log.log(self.step, {**row, "time/checkpoint_s": dt, **mem.read()})
        finally:  # a row refused by a full disk still frees the old checkpoints' space
            prune_checkpoints(self.out, self.cfg.train.checkpointing.keep)
        return path


def _unfit_key(changed: dict[str, tuple[Any, Any]], path: str | Path) -> str:
    """What a checkpoint that does not fit the model is blamed on: the changed key that sets what
    trains (``policy.model``, ``train.trainable``, ``train.top_k_layers``, ``train.lora.*``) with
    both values, or the checkpoint's folder where none changed."""
    shaped = [k for k in changed if k in ("policy.model", "train.trainable", "train.top_k_layers")
              or k.startswith("train.lora.")]
    if not shaped:
        return f"resume from {path}"
    # the cause, not its side effect (a new trainable setting changes top_k_layers' meaning)
    key = next(k for k in ("train.trainable", "policy.model", *shaped) if k in shaped)
    return f"{key}: the checkpoint trained {changed[key][0]!r}, this run {changed[key][1]!r}"


def _refuse_models_in(out: Path, cfg: TrainRunConfig) -> None:
    """``--overwrite`` removes ``out``'s checkpoints: a model the run starts from, or a teacher,
    inside them would be loaded and then deleted under the run, its config naming a folder gone."""
    teacher = cfg.train.distill.teacher.removeprefix("vllm:") if cfg.train.distill is not None else None
    for key, name in (("policy.model", cfg.policy.model), ("train.distill.teacher", teacher)):
        path = Path(name) if name else None
        if path is not None and path.exists() and path.resolve().is_relative_to(out.resolve()):
            raise ConfigError(f"{key}={name} is inside train.output.dir={out}, whose checkpoints --overwrite "
                              "removes: copy that model out of the folder first, or write this run elsewhere")


def train(cfg: TrainRunConfig, *, resume: bool = False, overwrite: bool = False, policy: Any = None,
          progress: bool = True, console: Console | None = None,
          rollouts: Callable[[Any, TrainRunConfig], RolloutSource] | None = None) -> dict[str, Any]:
    """Run ``agentrl train``: optional SFT warm start, then the RL loop; returns a summary.

    ``resume`` continues from the newest checkpoint in ``train.output.dir``. A
    fresh run refuses an output folder that holds checkpoints unless ``overwrite``,
    which removes the old run's checkpoints, TensorBoard events and saved trees once
    the new run's trainer is built (a config it refuses leaves them).
    ``train.steps=0`` without SFT is a dry run: the model and the rollout source
    are made, the plan printed, and nothing is evaluated or written.
    ``rollouts`` makes a rollout source other than the native engine (see ``Trainer``).
    """
    from .sft import sft_phase

    out = Path(cfg.train.output.dir)
    warm = sft_phase if cfg.sft.enabled else None
    dry = cfg.train.steps == 0 and warm is None
    with contextlib.nullcontext() if dry else output_lock(out):  # one run at a time in a folder
        replace = not dry and not resume and latest_checkpoint(out) is not None
        if replace and not overwrite:
            raise ConfigError(f"train.output.dir={out} already holds checkpoints: pass --resume to "
                              "continue that run, or --overwrite to start over")
        if replace:
            _refuse_models_in(out, cfg)
        trainer = Trainer(cfg, policy=policy, console=console, progress=progress, rollouts=rollouts)
        try:
            if replace:  # only now: a config the trainer refuses leaves the old run as it was
                for old in ("checkpoints", "tensorboard", "trees"):  # else TensorBoard and the viewer mix two runs
                    shutil.rmtree(out / old, ignore_errors=True)
            if dry:
                plan = run_plan(cfg)
                print_plan(trainer.console, plan)
                return {"dry_run": True, "plan": plan, "phases": {}, "checkpoint": None, "metrics": None,
                        "learning_curve": None}
            if resume and trainer.resume():
                trainer.console.print(f"resumed from step {trainer.step} ({out / 'checkpoints'})")
            elif resume:
                trainer.console.print(f"--resume: no checkpoint in {out / 'checkpoints'} yet, so the run starts "
                                      "from the beginning")
            return trainer.run(sft=warm)
        finally:
            trainer.close()
            del trainer
            # What the run left in reference cycles (frames of exceptions caught inside libraries,
            # progress bars) would otherwise wait for a full collection, holding models and caches.
            gc.collect()
