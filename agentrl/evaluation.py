"""``agentrl eval``: a policy over a whole split, in the rows the papers report.

    agentrl eval --env agentrl/ALFWorldReal-v0 --split valid_unseen --model PATH [--backend vllm]
    agentrl eval --env agentrl/WebShopReal-v0 --split test --model PATH --set env.kwargs.data_dir=...
    agentrl eval --env agentrl/ALFWorld-v0 --split valid_unseen --episodes 200 --model smollm2-135m
    agentrl eval --env ... --k 8 --samples 16 --temperature 0.7        (pass@8 from 16 samples a task)

What runs. Every task of the split once: an env that knows how many tasks its
split holds (a ``num_tasks`` attribute, as the real ALFWorld and WebShop envs
have) is played on seeds ``0 .. num_tasks - 1``, and ``--limit`` keeps the
first N; any other env on ``--episodes`` seeds from ``rollout.seed``.
``--split`` is passed as the env's ``split`` keyword (several, comma
separated, give one report each). Greedy decoding by default (temperature 0,
one sample a task); ``--k K`` samples ``--samples N`` (default K) episodes a
task at ``--temperature`` (default: the config's) and reports pass@k by the
unbiased estimator of Chen et al. 2021 (Codex), ``1 - C(n-c, k) / C(n, k)``
with ``c`` successes of ``n`` samples, next to pass@1 (``c / n``). Turns per
episode default to the env's own ``max_steps`` (50 for ALFWorld, 15 for
WebShop), so the env's limit is the one that ends an episode.

What it reports. One row per task family, and ``All``: the tasks, the
episodes, the success rate (pass@1), pass@k, the score (mean episode reward:
WebShop's score) and the episodes that failed for reasons outside the model
(an env or engine error, recorded on the tree). A failed episode counts as
not solved, so the rates cover every task of the split; the failures are
counted beside them with their reasons, never hidden. The family of a task is
``env.task_family(seed)`` when the env has it, else the ``task_type`` its
steps report (ALFWorld-v0), else there is one row. Rows come in the order of
the env's ``family_labels`` (ALFWorld's Pick, Look, Clean, Heat, Cool, Pick2)
and carry those labels; otherwise sorted by name.

Output: a table on the terminal, and ``summary.json`` (the reports) with
``trajectories.jsonl`` (every tree) in ``--out``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .config import Config
from .errors import AgentRLError, ConfigError, EnvError
from .types import RolloutTree

__all__ = ["EvalReport", "FamilyRow", "TaskResult", "evaluate_split", "pass_at_k", "register", "report_rows"]

ALL = "All"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with ``c`` successes in ``n`` samples (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", Eq. 1): ``1 - C(n-c,k)/C(n,k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(slots=True)
class TaskResult:
    """One task (seed) of the split: its family and what its ``n`` episodes did."""

    seed: int
    family: str
    n: int
    successes: int
    reward: float  # mean episode reward
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class FamilyRow:
    """A row of the table: one family, or ``All``. Rates are fractions of 1."""

    family: str
    label: str
    tasks: int
    episodes: int
    success: float
    pass_at_k: float
    score: float
    errors: int


@dataclass(slots=True)
class EvalReport:
    """Everything one split's evaluation found."""

    env: str
    split: str | None
    k: int
    samples: int
    temperature: float
    tasks: int
    rows: list[FamilyRow]
    results: list[TaskResult]
    failure_reasons: dict[str, int]
    wall_s: float
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _task_results(trees: list[RolloutTree], family_of: Callable[[int], str | None]) -> list[TaskResult]:
    out = []
    for tree in trees:
        seed = int(tree.meta["seed"])
        episodes = list(tree.episodes())
        family = family_of(seed)
        if family is None:
            family = next((str(n.info["task_type"]) for ep in episodes for n in ep.nodes
                           if "task_type" in n.info), ALL)
        errors = [ep.error for ep in episodes if ep.error]
        n = max(len(episodes), 1)
        out.append(TaskResult(seed, family, len(episodes), sum(ep.success and not ep.error for ep in episodes),
                              sum(ep.total_reward for ep in episodes if not ep.error) / n, errors))
    return out


def report_rows(results: list[TaskResult], k: int, labels: dict[str, str] | None = None) -> list[FamilyRow]:
    """Rows per family (in ``labels``' order, else sorted) and ``All``: rates over tasks,
    each task weighted once; a task without episodes counts as unsolved."""

    def row(family: str, label: str, rs: list[TaskResult]) -> FamilyRow:
        tasks = max(len(rs), 1)
        p1 = sum(r.successes / r.n if r.n else 0.0 for r in rs) / tasks
        pk = sum(pass_at_k(r.n, r.successes, k) if r.n >= k else 0.0 for r in rs) / tasks
        return FamilyRow(family, label, len(rs), sum(r.n for r in rs), p1, pk,
                         sum(r.reward for r in rs) / tasks, sum(len(r.errors) for r in rs))

    labels = labels or {}
    families = sorted({r.family for r in results}, key=lambda f: (list(labels).index(f) if f in labels
                                                                  else len(labels), f))
    rows = [row(f, labels.get(f, f), [r for r in results if r.family == f]) for f in families]
    if len(rows) != 1 or rows[0].family != ALL:
        rows.append(row(ALL, ALL, results))
    return rows


def _probe(env_id: str, kwargs: dict[str, Any]) -> Any:
    """Make the env once to read what it says about its split (num_tasks, families, max_steps)."""
    from .env import make_env

    try:
        env = make_env(env_id, **kwargs)
    except TypeError as e:
        if "split" in kwargs and "split" in str(e):
            raise ConfigError(f"{env_id} takes no split (its tasks are seeds): drop --split") from None
        raise EnvError(f"cannot make {env_id} with {kwargs}: {e}") from None
    return env


def evaluate_split(env_id: str, policy: Any, cfg: Config, split: str | None = None, k: int = 1,
                   samples: int | None = None, limit: int | None = None,
                   on_episode_done: Callable[[RolloutTree], None] | None = None,
                   on_start: Callable[[int], None] | None = None) -> tuple[EvalReport, list[RolloutTree]]:
    """Evaluate ``policy`` on every task of ``split`` (see the module docstring).

    ``cfg.sampling.temperature`` is used as given (the CLI sets 0 for greedy);
    ``cfg.rollout.episodes`` counts the tasks of an env without ``num_tasks``.
    ``on_start(total_episodes)`` is called before the first episode.
    """
    from .rollout import collect

    samples = samples or k
    if k < 1 or samples < k:
        raise ConfigError(f"--k must be >= 1 and --samples >= --k (got k={k}, samples={samples})")
    ev = cfg.model_copy(deep=True)
    kwargs = dict(ev.env.kwargs) | ({"split": split} if split is not None else {})
    env = _probe(env_id, kwargs)
    inner = env.unwrapped
    try:
        num_tasks = getattr(inner, "num_tasks", None)
        seeds = list(range(num_tasks)) if num_tasks else [ev.rollout.seed + i for i in range(ev.rollout.episodes)]
        if limit is not None:
            seeds = seeds[:limit]
        task_family = getattr(inner, "task_family", None)
        families = {s: task_family(s) for s in seeds} if callable(task_family) else {}
        labels = dict(getattr(inner, "family_labels", None) or {})
        max_steps = getattr(inner, "max_steps", None)
    finally:
        env.close()
    if "max_turns" not in ev.rollout.model_fields_set and isinstance(max_steps, int):
        ev.rollout.max_turns = max_steps  # the env's own limit ends the episode
    ev.env.kwargs = kwargs
    ev.rollout.group_size = samples
    ev.rollout.allocator, ev.rollout.budget = "independent", None
    ev.rollout.budget_unit = "leaves"
    if on_start:
        on_start(len(seeds) * samples)
    t0 = time.perf_counter()
    trees = collect(env_id, policy, ev, seeds, on_episode_done=on_episode_done)
    wall = time.perf_counter() - t0
    results = _task_results(trees, lambda s: families.get(s))
    reasons: dict[str, int] = {}
    for r in results:
        for e in r.errors:
            reason = e.split(":")[0][:80]
            reasons[reason] = reasons.get(reason, 0) + 1
    report = EvalReport(
        env=env_id, split=split, k=k, samples=samples, temperature=ev.sampling.temperature,
        tasks=len(seeds), rows=report_rows(results, k, labels), results=results, failure_reasons=reasons,
        wall_s=round(wall, 3),
        settings={"max_turns": ev.rollout.max_turns, "max_context_tokens": ev.rollout.max_context_tokens,
                  "max_new_tokens": ev.sampling.max_new_tokens, "show_admissible": ev.rollout.show_admissible,
                  "env_kwargs": {key: str(v) for key, v in kwargs.items()}})
    return report, trees


def format_report(report: EvalReport, title: str = "") -> Table:
    """The report as a rich table: one row per family and All, rates in percent."""
    table = Table(title=title or f"{report.env} {report.split or ''} (k={report.k}, samples={report.samples})")
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


# -- the command ---------------------------------------------------------------------------

console = Console()


def eval_command(
    env: Annotated[str, typer.Option(help="Env id, e.g. agentrl/ALFWorldReal-v0.")],
    split: Annotated[str | None, typer.Option(help="Split(s), comma separated, passed as the env's split.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name or folder (policy.model).")] = None,
    backend: Annotated[str | None, typer.Option(help="hf, vllm, openai or mock (policy.backend).")] = None,
    k: Annotated[int, typer.Option(help="pass@k; 1 with one sample is greedy evaluation.")] = 1,
    samples: Annotated[int | None, typer.Option(help="Episodes per task (>= k; default k).")] = None,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature; default 0 (greedy) for one sample, else sampling.temperature.")] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks of the split.")] = None,
    episodes: Annotated[int | None, typer.Option(
        help="Tasks of an env that does not say how many its split holds (rollout.episodes).")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config file.")] = None,
    out: Annotated[str, typer.Option(help="Output folder: summary.json and trajectories.jsonl.")] = "runs/eval",
    set_: Annotated[list[str] | None, typer.Option("--set", help="key.path=value override.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Evaluate a model over a whole split: success per task family and overall, as the papers report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .config import load_config
    from .distributed import placement
    from .env import resolve_env_id
    from .policy.for_run import open_policy
    from .policy.registry import resolve_backend
    from .rollout import write_run

    flags = {"policy.model": model, "policy.backend": backend, "rollout.episodes": episodes}
    overrides = [f"{key}={v}" for key, v in flags.items() if v is not None] + list(set_ or [])
    try:
        cfg = load_config(config, overrides)
        env_id = resolve_env_id(env, cfg.env.imports)
        if temperature is not None:
            cfg.sampling.temperature = temperature
        elif (samples or k) == 1:
            cfg.sampling.temperature = 0.0
        picked, why = resolve_backend(cfg.policy.backend)
        cfg.policy.backend = picked
        console.print(f"loading model [bold]{cfg.policy.model}[/] on backend [bold]{picked}[/] ({why})"
                      f"{placement(cfg)}")
        reports, all_trees = [], []
        with open_policy(cfg) as policy:
            for one in (split.split(",") if split else [None]):
                one = one.strip() if one else None
                with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=console, disable=not progress) as bar:
                    task = bar.add_task(f"{env_id} {one or ''}", total=None)
                    report, trees = evaluate_split(
                        env_id, policy, cfg, one, k, samples, limit,
                        on_episode_done=lambda _t, task=task: bar.advance(task),
                        on_start=lambda total, task=task: bar.update(task, total=total))
                reports.append(report)
                all_trees += trees
                console.print(format_report(report))
            worker_stats = dict(getattr(policy, "stats", {}))  # rollout workers: deaths, retries
    except AgentRLError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(code=2) from None
    summary = {"env": env_id, "model": cfg.policy.model, "backend": cfg.policy.backend, **worker_stats,
               "reports": [r.to_dict() for r in reports]}
    path = write_run(out, all_trees, summary)
    console.print(f"wrote {path / 'summary.json'} and {path / 'trajectories.jsonl'}")


def register(app: typer.Typer) -> None:
    """Add ``eval`` to the main ``agentrl`` command."""
    app.command("eval")(eval_command)
