"""``agentrl train`` and ``agentrl sft``: the command-line front of the trainer.

    agentrl train --config examples/train_guess_number.yaml [--resume] [--set train.optimizer.lr=1e-5]
    agentrl train --harness "python examples/harness/react_agent.py" --env agentrl/GuessNumber-v0
    agentrl sft   --config examples/train_alfworld_easy.yaml [--set sft.episodes=64]

``register(app, harness_rollouts=...)`` adds both commands to the main
``agentrl`` app, which hands in the harness rollout source
(``agentrl.proxy.harness_rollouts``): training does not import the proxy.
This module's own ``app`` runs them standalone (``python -m agentrl.train.cli
train ...``), without ``--harness``.
Heavy imports (torch, transformers) happen inside the commands.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import AgentRLError, ConfigError

__all__ = ["app", "register", "sft", "train"]

console = Console()
app = typer.Typer(help="Train an agent: RL with `train`, behaviour cloning with `sft`.",
                  no_args_is_help=True, pretty_exceptions_enable=False)

ConfigOpt = Annotated[Path | None, typer.Option(help="YAML config file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="key.path=value override.")]
ProgressOpt = Annotated[bool, typer.Option(help="Show progress bars.")]


def _load(config: Path | None, set_: list[str] | None, extra: list[str]) -> Any:
    from ..env import resolve_env_id
    from .config import load_train_config

    cfg = load_train_config(config, extra + list(set_ or []))
    cfg.env.id = resolve_env_id(cfg.env.id, cfg.env.imports)
    return cfg


def _warn_unread(cfg: Any, command: str) -> None:
    """Name the ``agentrl rollout`` keys this run does not read (one file serves every command),
    and held-out task seeds that are trained on."""
    from .plan import start_warnings

    for said in start_warnings(cfg, command):
        console.print(f"[yellow]warning:[/] {said}", highlight=False)


_PHASE_ROWS = {"start": ("start (base model)", ("start",)),
               "after_sft": ("after SFT", ("sft",)),
               "end": ("after RL", ("rl", "end"))}


def phase_seconds(metrics_path: str | Path) -> dict[str, float]:
    """Wall seconds of each phase row from ``metrics.jsonl``: an RL step's ``time/step_s`` (its
    parts overlap with asynchronous rollouts, and would count twice beside it), else the sum of
    a row's ``time/*`` entries.

    ``start`` is the first evaluation; ``after_sft`` the SFT phase and its
    evaluation; ``end`` the RL steps (rollouts, update, evals, checkpoints) and
    the final evaluation.
    """
    from .metrics import read_metrics

    out: dict[str, float] = {}
    for row, (_, logged) in _PHASE_ROWS.items():
        out[row] = sum(_row_seconds(m) for m in read_metrics(metrics_path) if m.get("phase") in logged)
    return out


def _row_seconds(m: dict[str, Any]) -> float:
    """A metrics row's wall seconds: an RL step's own total, else the sum of its ``time/*`` parts."""
    if isinstance(m.get("time/step_s"), int | float):
        return float(m["time/step_s"])
    return sum(v for k, v in m.items() if k.startswith("time/") and isinstance(v, int | float))


def phase_peak_memory(metrics_path: str | Path) -> dict[str, float]:
    """Peak resident memory (MB) of each phase row from ``metrics.jsonl`` (``memory/peak_rss_mb``)."""
    from .metrics import read_metrics

    out: dict[str, float] = {}
    for row, (_, logged) in _PHASE_ROWS.items():
        peaks = [m["memory/peak_rss_mb"] for m in read_metrics(metrics_path)
                 if m.get("phase") in logged and "memory/peak_rss_mb" in m]
        if peaks:
            out[row] = max(peaks)
    return out


def rl_segments(metrics_path: str | Path) -> list[dict[str, Any]]:
    """The RL phase cut at its evaluations (every ``train.evaluation.every`` steps, then the final one): for
    each, the step, held-out success and reward, and the seconds and peak MB of the rows since the
    cut before. The seconds add up to ``phase_seconds(...)["end"]``."""
    from .metrics import read_metrics

    out: list[dict[str, Any]] = []
    seconds, peak = 0.0, None
    for m in read_metrics(metrics_path):
        if m.get("phase") not in _PHASE_ROWS["end"][1]:
            continue
        seconds += _row_seconds(m)
        if "memory/peak_rss_mb" in m:
            peak = max(peak or 0.0, m["memory/peak_rss_mb"])
        if "eval/success" in m:
            out.append({"step": m.get("step"), "end": m.get("phase") == "end", "success": m["eval/success"],
                        "reward": m.get("eval/reward"), "seconds": seconds, "peak_mb": peak})
            seconds, peak = 0.0, None
    if out and (seconds or peak is not None):  # rows after the last evaluation (a resume of a finished run)
        out[-1]["seconds"] += seconds
        out[-1]["peak_mb"] = max(out[-1]["peak_mb"] or 0.0, peak or 0.0)
    return out


def _interrupted(cfg: Any, resumable: bool) -> typer.Exit:
    """Ctrl-C: say where the run stands. A checkpoint is written whole or not at all, so
    the newest one is where ``--resume`` continues."""
    from .checkpoint import checkpoint_dirs

    newest = checkpoint_dirs(cfg.train.output.dir)[-1:] if cfg is not None else []
    if not newest:
        console.print("interrupted before any checkpoint was written", highlight=False)
    elif resumable:  # soft_wrap: a path cut at the terminal's width cannot be pasted
        console.print(f"interrupted: the newest checkpoint is {newest[0]}; the same command with "
                      "--resume (and without --overwrite) continues from it", highlight=False, soft_wrap=True)
    else:
        console.print(f"interrupted: the newest checkpoint is {newest[0]}", highlight=False, soft_wrap=True)
    return typer.Exit(code=130)  # 128 + SIGINT, as a shell reports it


def _report(summary: dict[str, Any], wall: float) -> None:
    """The per-phase table: held-out success, mean reward, change from the previous phase, seconds,
    peak memory. A dry run printed its plan already."""
    if summary.get("dry_run"):
        console.print(json.dumps(summary["plan"]))
        return
    seconds = phase_seconds(summary["metrics"]) if summary.get("metrics") else {}
    peaks = phase_peak_memory(summary["metrics"]) if summary.get("metrics") else {}
    table = Table(title="held-out success rate")
    table.add_column("phase")
    table.add_column("success", justify="right")
    table.add_column("mean reward", justify="right")
    table.add_column("change", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("peak MB", justify="right")
    phases = dict(summary["phases"])
    rl = rl_segments(summary["metrics"]) if summary.get("metrics") else None
    if rl == [] and "after_sft" in phases:  # SFT alone (train.steps 0): no RL phase to show
        phases.pop("end", None)
    split_rl = bool(rl) and len(rl) > 1 and rl[-1]["end"] and rl[-1]["success"] == phases.get("end")
    rows = []  # (label, success, reward, seconds, peak MB)
    for phase, rate in phases.items():
        reward = summary.get("phase_rewards", {}).get(phase)
        if phase == "end" and split_rl:  # each evaluation during RL, with the steps before it
            rows += [(f"after RL step {g['step']}", g["success"], g["reward"], g["seconds"], g["peak_mb"])
                     for g in rl[:-1]]
            rows.append((f"after RL (step {rl[-1]['step']})", rate, reward, rl[-1]["seconds"], rl[-1]["peak_mb"]))
        else:
            rows.append((_PHASE_ROWS.get(phase, (phase,))[0], rate, reward, seconds.get(phase, 0.0),
                         peaks.get(phase)))
    prev = None
    for label, rate, reward, secs, peak in rows:
        table.add_row(label, f"{rate:.3f}", "" if reward is None else f"{reward:.3f}",
                      "" if prev is None else f"{rate - prev:+.3f}", f"{secs:.0f}",
                      "" if peak is None else f"{peak:.0f}")
        prev = rate
    console.print(table)
    rates = list(phases.values())
    if "after_sft" in phases and "end" in phases and len(rates) > 2:
        console.print(f"the RL phase's own change: {phases['after_sft']:.3f} -> {phases['end']:.3f} "
                      f"({phases['end'] - phases['after_sft']:+.3f})")
    if len(rates) > 1:
        console.print(f"trained policy vs starting policy on the same held-out seeds: "
                      f"{rates[-1]:.3f} vs {rates[0]:.3f} ({rates[-1] - rates[0]:+.3f})")
    console.print(json.dumps({**summary, "phase_seconds": {k: round(v, 1) for k, v in seconds.items()},
                              "phase_peak_rss_mb": peaks, "wall_s": round(wall, 1)}))


@app.command()
def train(
    config: ConfigOpt = None,
    resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Start over in an output folder with checkpoints.")] = False,
    steps: Annotated[int | None, typer.Option(
        help="Updates to run (train.steps). 0 with SFT runs the SFT alone; 0 without is a dry "
        "run: check, load, print the plan.")] = None,
    out: Annotated[str | None, typer.Option(help="Output folder (train.output.dir).")] = None,
    env: Annotated[str | None, typer.Option(help="Env id (env.id).")] = None,
    harness: Annotated[str | None, typer.Option(
        help="Command of an agent program that plays one episode through the proxy "
        "(train.harness). A leading python or python3 is this agentrl's own interpreter.")] = None,
    set_: SetOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """RL training: rollouts, credit, loss, optimizer step, weight sync, eval, checkpoints.

    With an ``sft`` section (``sft.episodes > 0``) an SFT warm start runs first.
    With ``--harness`` an unmodified agent program plays the episodes through
    the OpenAI-compatible proxy (see ``agentrl.proxy.rollouts``).
    Prints the held-out success rate at the start, after SFT and at the end.
    """
    from ..config import flag_overrides
    from .trainer import train as run_train

    # A flag's text is no YAML value: quoted as JSON (valid YAML), it arrives as written (--out 2024).
    flags = {"train.steps": steps, "train.output.dir": out, "env.id": env, "train.harness": harness}
    extra = flag_overrides(flags)
    t0, cfg = time.perf_counter(), None
    try:
        if resume and overwrite:  # which one wins is not obvious: --resume did, silently
            raise ConfigError("--resume continues the run in the output folder and --overwrite starts "
                              "it over: give one of them")
        cfg = _load(config, set_, extra)
        _warn_unread(cfg, "train")
        rollouts = None
        if cfg.train.harness is not None:
            if _HARNESS_ROLLOUTS is None:
                raise ConfigError("train.harness needs the proxy: run it as `agentrl train --harness ...`")
            rollouts = _HARNESS_ROLLOUTS
        summary = run_train(cfg, resume=resume, overwrite=overwrite, progress=progress, console=console,
                            rollouts=rollouts)
    except AgentRLError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        raise _interrupted(cfg, resumable=True) from None
    _report(summary, time.perf_counter() - t0)


@app.command()
def sft(
    config: ConfigOpt = None,
    episodes: Annotated[int | None, typer.Option(help="Expert episodes (sft.episodes).")] = None,
    out: Annotated[str | None, typer.Option(help="Output folder (train.output.dir).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Start over in an output folder with checkpoints.")] = False,
    set_: SetOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Behaviour cloning on an env's expert trajectories, then a checkpoint (and HF export).

    Uses the same token-exact contexts and loss masks as RL; evaluates on
    held-out seeds before and after.
    """
    from ..config import flag_overrides
    from .trainer import train as run_train

    extra = flag_overrides({"sft.episodes": episodes, "train.output.dir": out}) + ["train.steps=0"]
    t0, cfg = time.perf_counter(), None
    try:
        cfg = _load(config, set_, extra)
        if cfg.train.steps:  # a --set after the train.steps=0 above: RL the report would leave out
            raise ConfigError(f"agentrl sft runs no RL steps (train.steps={cfg.train.steps} was set): "
                              "run agentrl train for SFT then RL")
        if not cfg.sft.enabled:
            raise typer.BadParameter("set sft.episodes (or --episodes) above 0, or sft.levels")
        _warn_unread(cfg, "sft")
        summary = run_train(cfg, overwrite=overwrite, progress=progress, console=console)
    except AgentRLError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        raise _interrupted(cfg, resumable=False) from None
    # No RL steps ran: the "end" evaluation is the SFT'd policy again, not an "after RL" row.
    summary = {**summary, "phases": {k: v for k, v in summary["phases"].items() if k != "end"}}
    _report(summary, time.perf_counter() - t0)


_HARNESS_ROLLOUTS: Any = None  # set by ``register``: the proxy's harness rollout source


def register(main_app: typer.Typer, harness_rollouts: Any = None) -> None:
    """Add ``train`` and ``sft`` to the main ``agentrl`` command; ``harness_rollouts(policy, cfg)``
    makes the rollout source of ``train.harness`` (``agentrl.proxy.harness_rollouts``)."""
    global _HARNESS_ROLLOUTS
    _HARNESS_ROLLOUTS = harness_rollouts
    main_app.command("train")(train)
    main_app.command("sft")(sft)


if __name__ == "__main__":
    from ..cli import process_defaults

    process_defaults()
    app()
