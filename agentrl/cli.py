"""The ``agentrl`` command line (typer).

    agentrl rollout --env agentrl/GuessNumber-v0 --model smollm2-135m --episodes 8 --out runs/x
    agentrl envs list
    agentrl models list | prepare [NAME]
    agentrl sandbox ...      (see ``agentrl sandbox --help``)

Flags override the YAML given with ``--config``; ``--set key.path=value`` sets
any other config key. Heavy imports happen inside the commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from importlib import import_module
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import AgentRLError
from .heap import keep_freed_memory
from .models import cache_dir

__all__ = ["app", "main", "process_defaults"]

app = typer.Typer(help="Train LLM agents with RL on multi-turn, tool-using tasks.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
envs_app = typer.Typer(help="Registered environments.", no_args_is_help=True)
models_app = typer.Typer(help="Registered models.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")
app.add_typer(models_app, name="models")
console = Console()


def _print_version(asked: bool) -> None:
    """``--version``: agentrl's and the versions a bug report needs, read from the installed
    packages' metadata (torch is not imported)."""
    if not asked:
        return
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers", "vllm", "ray"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:  # optional: not installed here
            pass
    typer.echo(f"agentrl {__version__} ({', '.join(parts)})")
    raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print the version and exit.")] = False) -> None:
    """Train LLM agents with RL on multi-turn, tool-using tasks."""


def _fail(err: AgentRLError) -> typer.Exit:
    console.print(f"[bold red]error:[/] {err}", highlight=False)
    return typer.Exit(code=2)


@app.command()
def rollout(
    config: Annotated[Path | None, typer.Option(help="YAML config file.")] = None,
    env: Annotated[str | None, typer.Option(help="Env id (env.id).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name or folder (policy.model).")] = None,
    backend: Annotated[str | None, typer.Option(help="hf, vllm, openai or mock (policy.backend).")] = None,
    episodes: Annotated[int | None, typer.Option(help="Tasks: env seeds (rollout.episodes).")] = None,
    allocator: Annotated[str | None, typer.Option(help="Branch allocator (rollout.allocator).")] = None,
    allocator_option: Annotated[list[str] | None, typer.Option(
        "--allocator-option", help="Allocator option key=value (rollout.allocator.KEY).")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Episodes in flight (rollout.concurrency).")] = None,
    out: Annotated[str | None, typer.Option(help="Output folder (rollout.out_dir).")] = None,
    overwrite: Annotated[bool, typer.Option(
        help="Replace the results (summary.json, trajectories.jsonl) the output folder holds.")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="key.path=value override.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Run episodes of a policy in an env; write trajectories (JSONL trees) and a summary.
    A folder that holds results already is refused unless ``--overwrite``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .config import flag_overrides, load_config
    from .env import check_env_kwargs, resolve_env_id
    from .policy.for_run import open_policy, settle_for_command
    from .rollout import RunInterrupted, run_episodes, summarize, write_run
    from .rollout.allocators import ALLOCATORS
    from .rollout.budget import planned_episodes
    from .rollout.summary import check_no_results
    from .train.output_lock import output_lock

    flags = {"env.id": env, "policy.model": model, "policy.backend": backend,
             "rollout.episodes": episodes, "rollout.allocator.name": allocator,
             "rollout.concurrency": concurrency, "rollout.out_dir": out}
    overrides = flag_overrides(flags)  # a flag's text arrives as written, not as YAML reads it
    overrides += [f"rollout.allocator.{kv}" for kv in allocator_option or []]
    overrides += list(set_ or [])
    with contextlib.ExitStack() as held:  # the folder's run lock, released once the run is written
        try:
            cfg = load_config(config, overrides, ignore=("train", "sft"))  # a train config serves too
            cfg.env.id = resolve_env_id(cfg.env.id, cfg.env.imports)
            check_env_kwargs(cfg.env.id, cfg.env.kwargs, imports=cfg.env.imports)  # else every episode fails
            # one run at a time in a folder it can write, checked before the episodes, not after them
            held.enter_context(output_lock(Path(cfg.rollout.out_dir), "rollout.out_dir"))
            check_no_results(cfg.rollout.out_dir, "rollout.out_dir", overwrite)  # under the lock
            console.print(settle_for_command(cfg))
            r = cfg.rollout
            with open_policy(cfg) as policy, Progress(
                    "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, disable=not progress) as bar:
                task = bar.add_task(f"{cfg.env.id} episodes", total=planned_episodes(r, r.episodes))
                t0 = time.perf_counter()
                try:
                    trees, interrupted = run_episodes(cfg.env.id, policy, cfg,
                                                      on_episode_done=lambda _t: bar.advance(task)), None
                except RunInterrupted as stop:  # what finished is written, and said to be partial
                    trees, interrupted = stop.trees, {"interrupted": True, "tasks_finished": len(stop.trees),
                                                      "tasks_planned": r.episodes}
                wall = time.perf_counter() - t0
                bar.update(task, total=bar.tasks[task].completed)  # a budget may stop short of the plan
                worker_stats = dict(getattr(policy, "stats", {}))  # rollout workers: deaths, retries
        except AgentRLError as e:
            raise _fail(e) from None
        summary = {"env": cfg.env.id, "model": cfg.policy.model, "backend": cfg.policy.backend,
                   **({"precision": cfg.policy.precision} if cfg.policy.backend == "hf" else {}),
                   **(interrupted or {}), "allocator": r.allocator.name, **summarize(trees, wall), **worker_stats,
                   "branch_points": sum(len(n.children) > 1 for t in trees for n in t.nodes.values()),
                   "allocation_report": trees[0].meta.get("allocation_report", {}) if trees else {}}
        path = write_run(cfg.rollout.out_dir, trees, summary)
    table = Table(title=f"rollout summary ({path})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        shown = f"{v:.3f}" if isinstance(v, float) else json.dumps(v) if isinstance(v, dict) else str(v)
        table.add_row(k, shown)
    console.print(table)
    if ALLOCATORS[r.allocator.name].needs_snapshots and summary["branch_points"] == 0 and not interrupted:
        console.print(f"[yellow]warning:[/] allocator {r.allocator.name!r} made no branch: every leaf is a fresh "
                      "episode. On single-turn tasks set --allocator-option in_turn=true (key_state, "
                      "entropy_branch) to fork inside a turn.", highlight=False)
    if interrupted:
        console.print(f"interrupted: wrote the {len(trees)} of {r.episodes} task(s) whose episodes had all "
                      "ended", highlight=False)
        raise typer.Exit(code=130)  # 128 + SIGINT, as a shell reports it


@app.command()
def tree(
    path: Annotated[Path, typer.Argument(
        help="A run folder (of `agentrl rollout`, or `agentrl train`'s trees/step-NNNNNN.jsonl) "
        "or a trees JSONL file.")],
    index: Annotated[int, typer.Option(help="Which tree (task) of the run, or of the step with --step.")] = 0,
    step: Annotated[int | None, typer.Option(help="Only the trees of this training step.")] = None,
    width: Annotated[int, typer.Option(min=1, help="Characters of each action shown.")] = 60,
    text: Annotated[bool, typer.Option(
        "--text", help="Also show the task's instruction and each turn's observation.")] = False,
) -> None:
    """Print one rollout tree: each turn's action, reward, branch points and the counters."""
    from .rollout import format_tree
    from .viewer.run import open_run

    try:
        run = open_run(path)
    except (OSError, ValueError) as e:
        typer.echo(f"error: cannot read trees from {path}: {e}", err=True)
        raise typer.Exit(code=2) from None
    if run.skipped:  # a torn line's tree is missing from the indices and steps below
        typer.echo(f"warning: {run.skipped_note}", err=True)
    picked = [s.index for s in run.summaries if step is None or s.step == step]
    if not picked:
        steps = [s for s in run.steps() if s is not None]
        where = f" at step {step} (steps: {steps})" if step is not None else ""
        typer.echo(f"error: no trees in {path}{where}: a run folder holds trajectories.jsonl (agentrl "
                   "rollout) or trees/step-NNNNNN.jsonl (agentrl train, train.output.save_trees > 0)", err=True)
        raise typer.Exit(code=2)
    if not -len(picked) <= index < len(picked):
        typer.echo(f"error: --index {index} out of range: {path} holds {len(picked)} trees", err=True)
        raise typer.Exit(code=2)
    typer.echo(format_tree(run.tree(picked[index]), width=width, text=text))


@envs_app.command("list")
def envs_list() -> None:
    """Show every registered env id."""
    from .env import list_envs

    for env_id in list_envs():
        typer.echo(env_id)


@models_app.command("list")
def models_list() -> None:
    """Show registered models and whether they are prepared."""
    from .models import list_models

    table = Table()
    for col in ("name", "description", "ready"):
        table.add_column(col)
    for name, desc, ready in list_models():
        table.add_row(name, desc, "yes" if ready else "no (agentrl models prepare)")
    console.print(table)


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="Model to prepare.")] = "smollm2-135m",
    force: Annotated[bool, typer.Option(help="Convert again even if cached.")] = False,
) -> None:
    """Convert a registered model to safetensors in the cache (once)."""
    from .models import prepare_model

    try:
        path = prepare_model(name, force=force)
    except AgentRLError as e:
        raise _fail(e) from None
    typer.echo(json.dumps({"model": name, "path": str(path)}))


def _harness_rollouts(policy: object, cfg: object) -> object:
    from .proxy.rollouts import harness_rollouts

    return harness_rollouts(policy, cfg)


def _mount_plugins() -> None:
    """Sub-commands that live in other packages: train, sft, proxy, env serve, sandbox."""
    # agentrl train, agentrl sft; --harness rolls out through the proxy, handed in here
    import_module("agentrl.train.cli").register(app, harness_rollouts=_harness_rollouts)
    import_module("agentrl.proxy.cli").mount(app)  # agentrl proxy ..., agentrl env serve
    import_module("agentrl.eval_cli").register(app)  # agentrl eval
    import_module("agentrl.viewer.cli").register(app)  # agentrl view, agentrl report
    try:
        sandbox_cli = import_module("agentrl.sandboxes.cli")
    except ImportError:
        return
    app.add_typer(sandbox_cli.app, name="sandbox", help="Sandbox images and servers.")


def process_defaults() -> None:
    """Environment defaults for an ``agentrl`` process; a value the user set is kept."""
    # torch's OpenMP threads spin while they wait; on a small shared CPU that
    # costs 3-30x when another process holds a core. Must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # train.compile's kernels: torch keeps them in /tmp, which a reboot often empties, and make
    # run's SFT then compiles about a minute longer (bench/make_run.json, inductor_cache). Must be
    # set before the first compile. Without a writable home, torch's default stays.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:
            kernels = cache_dir() / "inductor"
            kernels.mkdir(parents=True, exist_ok=True)
        except (OSError, RuntimeError):  # RuntimeError: Path.home() with no HOME and no passwd entry
            return
        if os.access(kernels, os.W_OK):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kernels)


def main() -> None:
    process_defaults()
    try:
        keep_freed_memory()  # opt-in: a step's buffers reuse the last step's pages (agentrl.heap)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    _mount_plugins()
    app()
