"""``agentrl eval``: the command over ``agentrl.evaluation.evaluate_split``, its table and output.

    agentrl eval --env agentrl/ALFWorldReal-v0 --split valid_unseen --model PATH [--backend vllm]
    agentrl eval --env agentrl/WebShopReal-v0 --split test --model PATH --set env.kwargs.data_dir=...
    agentrl eval --env agentrl/ALFWorld-v0 --split valid_unseen --episodes 200 --model smollm2-135m
    agentrl eval --env ... --k 8 --samples 16 --temperature 0.7        (pass@8 from 16 samples a task)

``--env`` defaults to the ``--config``'s ``env.id``, so one config serves
``train``, ``rollout`` and ``eval``; given a training config, an env that does not
count its tasks plays the run's held-out ones (``train.evaluation``: its seeds,
env kwargs and temperature, with ``rollout.max_turns``), not its training tasks, and one that
counts them plays the whole split of ``train.evaluation.env_kwargs`` (valid_seen, say), not its
default one. ``--split`` takes several splits, comma separated, and gives one report each.
Greedy decoding by default (temperature 0, one sample a task); ``--k K``
samples ``--samples N`` (default K) episodes a task at ``--temperature``
(default: the config's). What runs and what the rows mean is in
``agentrl.evaluation``. Output: a table on the terminal, and ``summary.json``
(the reports) with ``trajectories.jsonl`` (every tree) in ``--out``, a folder that
holds no results yet unless ``--overwrite``. On Ctrl-C the
tasks that had finished are reported and written (``"interrupted": true`` in their
report), and the exit code is 130.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from .config import Config
from .errors import AgentRLError, ConfigError
from .evaluation import EvalReport, EvaluationConfig, SplitPlan, evaluate_split, plan_split
from .strict import StrictModel
from .types import RolloutTree

__all__ = ["eval_command", "format_report", "register", "split_names", "train_held_out", "trained_model_hint"]

def format_report(report: EvalReport, title: str = "") -> Table:
    """The report as a rich table: one row per family and All, rates in percent."""
    table = Table(title=title or f"{report.env} {report.split or ''} (k={report.k}, samples={report.samples})",
                  caption=f"interrupted: {len(report.results)} of {report.tasks} tasks" if report.interrupted else None)
    cols = ["family", "tasks", "success %"] + ([f"pass@{report.k} %"] if report.k > 1 else [])
    cols += ["score", "errors"]
    for col in cols:
        table.add_column(col, justify="left" if col == "family" else "right")
    for r in report.rows:
        cells = [r.label, str(r.tasks), f"{100 * r.success:.1f}"]
        cells += [f"{100 * r.pass_at_k:.1f}"] if report.k > 1 else []
        cells += [f"{100 * r.score:.1f}", str(r.errors)]
        table.add_row(*cells)
    return table


console = Console()


def split_names(text: str | None) -> list[str | None]:
    """``--split``'s comma-separated names; ``[None]`` (the env's default split) when not given.
    An empty name (``a,`` or ``a,,b``) is an error: it evaluated the default split again; so
    is a name given twice."""
    if text is None:
        return [None]
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ConfigError(f"--split {text!r}: an empty split name; give the names, comma separated")
    if twice := next((name for i, name in enumerate(names) if name in names[:i]), None):
        # it was played twice, its trees written twice into one trajectories.jsonl
        raise ConfigError(f"--split {text!r}: split {twice!r} is given twice; give each once")
    return list(names)


def train_held_out(cfg: Config) -> EvaluationConfig | None:
    """The held-out evaluation of a training config (its ``train.evaluation``), which an env that
    does not count its split plays; None for a config without a ``train`` section, or one that
    names the tasks itself (``rollout.seed``, ``rollout.episodes``, ``--episodes``)."""
    from .config import _format, ignored_section, moved_keys
    from .train.config import MOVED_KEYS

    train = ignored_section(cfg, "train")
    if not train or {"seed", "episodes"} & cfg.rollout.model_fields_set:
        return None
    old = {key: new for key, new in MOVED_KEYS.items() if new.startswith("evaluation.")}  # eval_seed_start...
    try:
        section = moved_keys(train, old, "train").get("evaluation")
    except ValueError as e:  # an old key beside its new one
        raise ConfigError(f"invalid config: {e}") from None
    try:
        return _HeldOut.model_validate({"train": {"evaluation": section or {}}}).train.evaluation
    except ValidationError as e:  # the message agentrl train gives: key paths, did-you-mean
        raise ConfigError(_format(e, _HeldOut)) from None


class _TrainEvaluation(StrictModel):
    evaluation: EvaluationConfig


class _HeldOut(StrictModel):
    """The one part of a training config that ``agentrl eval`` reads, nested as in the file, so
    that an error names its whole key path."""

    train: _TrainEvaluation


def eval_command(
    env: Annotated[str | None, typer.Option(
        help="Env id, e.g. agentrl/ALFWorldReal-v0; default: the --config's env.id.")] = None,
    split: Annotated[str | None, typer.Option(help="Split(s), comma separated, passed as the env's split.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name or folder (policy.model).")] = None,
    backend: Annotated[str | None, typer.Option(help="hf, vllm, openai or mock (policy.backend).")] = None,
    k: Annotated[int, typer.Option(help="pass@k; 1 with one sample is greedy evaluation.")] = 1,
    samples: Annotated[int | None, typer.Option(help="Episodes per task (>= k; default k).")] = None,
    temperature: Annotated[float | None, typer.Option(
        min=0.0, help="Sampling temperature; default 0 (greedy) for one sample, else sampling.temperature.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N tasks of the split.")] = None,
    episodes: Annotated[int | None, typer.Option(
        help="Tasks of an env that does not say how many its split holds (rollout.episodes).")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config file.")] = None,
    out: Annotated[str, typer.Option(help="Output folder: summary.json and trajectories.jsonl.")] = "runs/eval",
    overwrite: Annotated[bool, typer.Option(help="Replace the results the output folder holds.")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="key.path=value override.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Evaluate a model over a whole split: success per task family and overall, as the papers report."""
    from .config import flag_overrides, load_config
    from .env import check_env_kwargs, resolve_env_id
    from .policy.for_run import open_policy, settle_for_command
    from .rollout import write_run
    from .rollout.summary import check_no_results
    from .train.output_lock import output_lock

    flags = {"policy.model": model, "policy.backend": backend, "rollout.episodes": episodes,
             "sampling.temperature": temperature}  # checked with the config: a bad one names its key
    overrides = flag_overrides(flags) + list(set_ or [])  # a flag's text as written (--model 0123)
    with contextlib.ExitStack() as held:  # the folder's run lock, released once the run is written
        try:
            cfg = load_config(config, overrides, ignore=("train", "sft"))  # a train config serves too
            if env is None and config is None:  # the default env.id is a demo, not what was meant
                raise ConfigError("which env? give --env, or a --config whose env.id names it")
            env_id = cfg.env.id = resolve_env_id(env or cfg.env.id, cfg.env.imports)
            check_env_kwargs(env_id, cfg.env.kwargs, imports=cfg.env.imports)  # else every episode fails
            one_sample, sampling_temperature = temperature is None and (samples or k) == 1, cfg.sampling.temperature
            if one_sample:
                cfg.sampling.temperature = 0.0
            loading = settle_for_command(cfg)
            # every split read before the model loads: a bad --k or split fails in seconds
            held_out = train_held_out(cfg)
            plans = [plan_split(env_id, cfg, one, k, samples, limit, held_out) for one in split_names(split)]
            for p in plans:
                if p.held_out and one_sample and held_out is not None:  # as the training run evaluated
                    p.cfg.sampling.temperature = (sampling_temperature if held_out.temperature is None
                                                  else held_out.temperature)
            if episodes is not None and (counted := next((p for p in plans if p.num_tasks), None)):
                raise ConfigError(f"--episodes {episodes} is not read here: {env_id} says its split "
                                  f"{counted.split!r} holds {counted.num_tasks} tasks, and all are played; "
                                  "give --limit N for the first N")
            if not out:  # Path("") is the working directory: an unset shell variable, most likely
                raise ConfigError("--out is empty: give the run a folder")
            # one run at a time in a folder it can write, checked before the episodes, not after them
            held.enter_context(output_lock(Path(out), "--out"))
            check_no_results(out, "--out", overwrite)  # under the lock: no other run writes between
            console.print(loading)
            if model is None and (hint := trained_model_hint(cfg)):
                console.print(f"[yellow]note:[/] {hint}", highlight=False)
            for p in plans:
                if p.held_out:
                    console.print(f"{env_id} does not count its tasks: playing train.evaluation's held-out "
                                  f"tasks ({len(p.seeds)} seeds, {p.seeds[0]} first{_kwargs_said(p, cfg)}, "
                                  f"temperature {p.cfg.sampling.temperature:g}), as the training run "
                                  "evaluated; --episodes or rollout.seed picks others",
                                  highlight=False)
                elif p.held_out_kwargs and held_out is not None:
                    console.print(f"{env_id} is made with train.evaluation.env_kwargs {held_out.env_kwargs}, "
                                  f"as the training run evaluated: all {len(p.seeds)} tasks; --split "
                                  "picks another", highlight=False)
            with open_policy(cfg) as policy:
                def written(reports: list[EvalReport], trees: list[RolloutTree], interrupted: bool) -> Path:
                    return write_run(out, trees, _summary(env_id, cfg, policy, reports, interrupted))

                reports, trees, interrupted = _evaluate_splits(env_id, policy, cfg, plans, progress, written)
                if interrupted and reports:  # the summary says the run was cut short
                    written(reports, trees, True)
        except AgentRLError as e:
            console.print(f"[bold red]error:[/] {e}", highlight=False)
            raise typer.Exit(code=2) from None
    if reports:
        console.print(f"wrote {Path(out) / 'summary.json'} and {Path(out) / 'trajectories.jsonl'}")
    if interrupted:
        console.print("interrupted: the reports cover only the tasks that had finished" if reports else
                      "interrupted before any task had finished: nothing written", highlight=False)
        raise typer.Exit(code=130)  # 128 + SIGINT, as a shell reports it


def _evaluate_splits(env_id: str, policy: Any, cfg: Config, plans: list[SplitPlan], progress: bool,
                     written: Callable[[list[EvalReport], list[RolloutTree], bool], Any],
                     ) -> tuple[list[EvalReport], list[RolloutTree], bool]:
    """Each split in turn, with its progress bar and table; ``written(reports, trees, False)``
    writes the run so far as each split ends, so that a Ctrl-C in a later one loses no finished
    split (all were written at the end, and one between splits lost them all). Returns the
    reports, their trees and whether Ctrl-C stopped it (the last report then covers the tasks
    that had finished)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .rollout import RunInterrupted

    reports: list[EvalReport] = []
    trees: list[RolloutTree] = []
    for plan in plans:
        try:
            with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console, disable=not progress) as bar:
                task = bar.add_task(f"{env_id} {plan.split or ''}", total=None)
                report, split_trees = evaluate_split(
                    env_id, policy, cfg, plan=plan,
                    on_episode_done=lambda _t, task=task: bar.advance(task),
                    on_start=lambda total, task=task: bar.update(task, total=total))
        except RunInterrupted as stop:  # the finished tasks are reported and written
            if stop.report is not None:  # None: before the split's episodes began
                reports.append(stop.report)
                trees += stop.trees
                console.print(format_report(stop.report))
            return reports, trees, True
        except KeyboardInterrupt:  # between splits: the finished ones are written already
            return reports, trees, True
        reports.append(report)
        trees += split_trees
        written(reports, trees, False)
        console.print(format_report(report))
    return reports, trees, False


def _summary(env_id: str, cfg: Config, policy: Any, reports: list[EvalReport], interrupted: bool) -> dict[str, Any]:
    """``summary.json``: what was evaluated, the rollout workers' counters and the reports."""
    return {"env": env_id, "model": cfg.policy.model, "backend": cfg.policy.backend,
            **({"precision": cfg.policy.precision} if cfg.policy.backend == "hf" else {}),
            **dict(getattr(policy, "stats", {})),  # rollout workers: deaths, retries
            **({"interrupted": True} if interrupted else {}),
            "reports": [r.to_dict() for r in reports]}


def trained_model_hint(cfg: Config) -> str | None:
    """What to say when a training config's ``policy.model`` (where its run starts) is about to
    be evaluated while its run folder (``train.output.dir``) holds checkpoints: the trained model
    is the run's folder. None for a run config, a run without checkpoints, or a model in the run."""
    from .config import expand_path, ignored_section
    from .models import checkpoint_folders

    train = ignored_section(cfg, "train")
    output = train.get("output") if isinstance(train.get("output"), dict) else {}
    folder = output.get("dir") or train.get("out_dir") or ("runs/train" if train else None)
    if not isinstance(folder, str):
        return None
    try:
        run = Path(expand_path(folder))
        if not checkpoint_folders(run / "checkpoints"):
            return None
        model = Path(cfg.policy.model).resolve()
        if model == run.resolve() or run.resolve() in model.parents:
            return None
    except (OSError, ValueError):  # an unset variable, an unreadable folder: no hint, no error
        return None
    return (f"policy.model={cfg.policy.model} is the model the training run started from: give --model {run} "
            "for the model it trained (its newest checkpoint)")


def _kwargs_said(plan: SplitPlan, cfg: Config) -> str:
    """The env keywords the held-out tasks add to ``env.kwargs``, as the line about them says them."""
    added = {key: v for key, v in plan.kwargs.items() if cfg.env.kwargs.get(key, object()) != v}
    return f", env kwargs {added}" if added else ""


def register(app: typer.Typer) -> None:
    """Add ``eval`` to the main ``agentrl`` command."""
    app.command("eval")(eval_command)
