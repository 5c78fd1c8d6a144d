"""Evaluation in one place: the trainer's held-out episodes and ``agentrl eval``'s whole split.

Both play a copy of the run config made by ``eval_config``: a fixed number of
independent episodes a task and no other budget (a training budget counted in
turns or tokens cannot cut an evaluation short), the evaluation temperature
and env keyword overrides.

**During training** (``train.evaluation``, ``EvaluationConfig``). The trainer
calls ``evaluate_held_out`` at the start, after SFT, every
``train.evaluation.every`` steps and at the end: one episode on each held-out
task seed (``held_out_seeds``), greedy unless ``train.evaluation.temperature`` says
otherwise (as ``agentrl eval``), and the metrics ``eval/success``,
``eval/reward``, ``eval/turns``, ``eval/failed``, ``time/eval_s`` (and
``eval/invalid_action_frac`` where the env reports invalid actions). As on a
whole split, a failed episode counts as not solved (reward 0): the rates cover
every held-out seed, so a crashing env cannot raise them, and the trainer's
number and ``agentrl eval``'s agree; ``eval/failed`` counts the failures.

**On a whole split** (``evaluate_split``; the command is ``agentrl.eval_cli``).
Every task of the split once: an env that knows how many tasks its
split holds (a ``num_tasks`` attribute, as the real ALFWorld and WebShop envs
have) is played on seeds ``0 .. num_tasks - 1``, and ``limit`` keeps the
first N; any other env on a training config's held-out seeds (``train.evaluation``: the tasks
the training run evaluated on) unless ``rollout.seed`` or ``rollout.episodes`` is given, else
on ``rollout.episodes`` seeds from ``rollout.seed``. Given a training config with held-out
tasks and no split, either kind of env is made with ``train.evaluation.env_kwargs`` over
``env.kwargs``: the split the training run evaluated on (ALFWorld's valid_seen, say), played
whole where the env counts its tasks.
``split`` is passed as the env's ``split`` keyword. ``k`` and ``samples``
(default k) episodes a task give pass@k by the unbiased estimator of Chen et
al. 2021 (Codex), ``1 - C(n-c, k) / C(n, k)`` with ``c`` successes of ``n``
samples, next to pass@1 (``c / n``); several samples a task need a temperature above
0 (greedy ones would play one episode over). Turns per episode default to the env's
own ``max_steps`` (50 for ALFWorld, 15 for WebShop), so the env's limit is
the one that ends an episode.

What a split reports. One row per task family, and ``All``: the tasks, the
episodes, the success rate (pass@1), pass@k, the score (mean episode reward:
WebShop's score) and the episodes that failed for reasons outside the model
(an env or engine error, recorded on the tree). A failed episode counts as
not solved, so the rates cover every task of the split; the failures are
counted beside them with their reasons, never hidden. The family of a task is
``env.task_family(seed)`` when the env has it, else the ``task_type`` its
steps report (ALFWorld-v0), else there is one row. Rows come in the order of
the env's ``family_labels`` (ALFWorld's Pick, Look, Clean, Heat, Cool, Pick2)
and carry those labels; otherwise sorted by name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from pydantic import Field, field_validator

from .config import MAX_TASKS, Config, Seed, _Strict, check_task_seeds, check_temperature
from .errors import AgentRLError, ConfigError, EnvError
from .types import RolloutTree

__all__ = [
    "EvalReport",
    "EvaluationConfig",
    "FamilyRow",
    "SplitPlan",
    "TaskResult",
    "eval_config",
    "evaluate_held_out",
    "evaluate_split",
    "held_out_seeds",
    "pass_at_k",
    "plan_split",
    "report_rows",
]

ALL = "All"
C = TypeVar("C", bound=Config)


class EvaluationConfig(_Strict):
    """Held-out evaluation during training (``train.evaluation``): which task seeds, how
    often, and how they are played (``agentrl.evaluation``)."""

    every: int = Field(0, ge=0, description="Evaluate every this many steps (0: only at "
                       "start and end). Was eval_every.")
    episodes: int = Field(16, ge=0, le=MAX_TASKS, description="Held-out episodes per evaluation (at most "
                          "1,000,000). Was eval_episodes.")
    start: bool = Field(True, description="Evaluate the starting model before SFT and RL. "
                        "false skips it when its success is known already (runs that share "
                        "one starting checkpoint and held-out seeds). Was eval_start.")
    seed_start: Seed = Field(1_000_000, description="First held-out task seed. Was eval_seed_start.")
    task_seeds: list[Seed] | None = Field(None, description="Explicit held-out task seeds; overrides "
                                         "seed_start and episodes. Was eval_task_seeds.")
    temperature: float | None = Field(
        0.0, ge=0.0, description="Sampling temperature of evaluation: 0 (default) is greedy, as "
        "agentrl eval plays, so one config evaluates the same in both; null: sampling.temperature, "
        "the training rollouts' own. Was eval_temperature.")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Env kwargs overridden for "
                                       "evaluation (e.g. another split). Was eval_env_kwargs.")

    _temperature = field_validator("temperature")(check_temperature)
    _task_seeds = field_validator("task_seeds")(check_task_seeds)


def held_out_seeds(ev: EvaluationConfig) -> list[int]:
    """Held-out task seeds: the explicit list, else ``episodes`` from ``seed_start``."""
    if ev.task_seeds:
        return list(ev.task_seeds)
    return [ev.seed_start + i for i in range(ev.episodes)]


def eval_config(cfg: C, group_size: int, temperature: float | None = None,
                env_kwargs: dict[str, Any] | None = None) -> C:
    """A copy of ``cfg`` to evaluate with: ``group_size`` independent episodes a task and no
    budget beyond them (counted in leaves, so a turns budget of training cannot cut it short),
    at ``temperature`` when given, ``env_kwargs`` over ``env.kwargs``."""
    ev = cfg.model_copy(deep=True)
    ev.rollout.group_size = group_size
    ev.rollout.allocator, ev.rollout.budget = "independent", None
    ev.rollout.budget_unit = "leaves"
    if temperature is not None:
        ev.sampling.temperature = temperature
    ev.env.kwargs = {**ev.env.kwargs, **(env_kwargs or {})}
    return ev


def evaluate_held_out(policy: Any, cfg: Config, ev: EvaluationConfig,
                      on_episode_done: Callable[[RolloutTree], None] | None = None,
                      collect_fn: Callable[..., list[RolloutTree]] | None = None) -> dict[str, Any]:
    """The training run's evaluation: success and reward of ``policy`` on the held-out task
    seeds of ``ev``, one episode each, as the ``eval/...`` metrics (see the module docstring).

    ``collect_fn`` replaces ``agentrl.rollout.collect`` (a harness's rollouts).
    """
    from .rollout import collect, summarize

    run = eval_config(cfg, 1, ev.temperature, ev.env_kwargs)
    t0 = time.perf_counter()
    trees = (collect_fn or collect)(run.env.id, policy, run, held_out_seeds(ev),
                                    on_episode_done=on_episode_done)
    s = summarize(trees, time.perf_counter() - t0)
    frac = s.get("invalid_action_frac")
    episodes = [ep for t in trees for ep in t.episodes()]
    n = max(len(episodes), 1)
    return {"eval/success": sum(ep.success and not ep.error for ep in episodes) / n,
            "eval/reward": sum(0.0 if ep.error else ep.total_reward for ep in episodes) / n,
            "eval/turns": s["mean_turns"], "eval/failed": s["failed_episodes"],
            "time/eval_s": s["wall_s"], **({} if frac is None else {"eval/invalid_action_frac": frac})}


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
    interrupted: bool = False  # Ctrl-C: the rows cover only the tasks that had finished

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
    except AgentRLError:
        raise
    except TypeError as e:
        if "split" in kwargs and "split" in str(e):
            raise ConfigError(f"{env_id} takes no split (its tasks are seeds): drop --split") from None
        raise EnvError(f"cannot make {env_id} with {kwargs}: {e}") from None
    except Exception as e:  # the env's own error (missing data, say): a message, not a traceback
        raise EnvError(f"cannot make {env_id} with {kwargs}: {type(e).__name__}: {e}") from e
    return env


@dataclass(slots=True)
class SplitPlan:
    """What ``evaluate_split`` plays on one split, found before any policy loads
    (``plan_split``): its task seeds, their families and the config the episodes run with."""

    env_id: str
    split: str | None
    k: int
    samples: int
    seeds: list[int]
    families: dict[int, str]
    labels: dict[str, str]
    cfg: Config
    kwargs: dict[str, Any]
    num_tasks: int | None = None  # what the env says its split holds; None: rollout.episodes counts
    held_out: bool = False  # the seeds are a training config's held-out ones (train.evaluation)
    held_out_kwargs: bool = False  # the env keywords add train.evaluation.env_kwargs to env.kwargs


def _read_split(env_id: str, kwargs: dict[str, Any], split: str | None) -> tuple[int | None, Any, dict, Any]:
    """What the env made with ``kwargs`` says about its split: the tasks it holds (None: it does
    not say), its ``task_family``, ``family_labels`` and ``max_steps``. Raises ``ConfigError``."""
    env = _probe(env_id, kwargs)
    inner = env.unwrapped
    try:
        num_tasks = getattr(inner, "num_tasks", None)
        if num_tasks is not None and num_tasks < 1:  # not "unknown": rollout.episodes other seeds
            raise ConfigError(f"{env_id}: split {split!r} holds no tasks (num_tasks={num_tasks}); "
                              "check the env's data folder (env.kwargs) and the split's name")
        task_family = getattr(inner, "task_family", None)
        return (num_tasks or None, task_family if callable(task_family) else None,
                dict(getattr(inner, "family_labels", None) or {}), getattr(inner, "max_steps", None))
    finally:
        env.close()


def plan_split(env_id: str, cfg: C, split: str | None = None, k: int = 1, samples: int | None = None,
               limit: int | None = None, held_out: EvaluationConfig | None = None) -> SplitPlan:
    """Check the settings and read the split from the env, without a policy: ``agentrl eval``
    plans every split before the model loads, so that a bad ``--k``, a split the env does not
    take or one with no tasks fails in seconds. ``held_out``: a training config's evaluation,
    whose seeds an env that does not count its split plays instead of ``rollout.episodes`` from
    ``rollout.seed``, and whose env keywords (unless ``split`` is given) any env is made with.
    Raises ``ConfigError``."""
    samples = k if samples is None else samples  # 0 is a bad value, not "default"
    if k < 1 or samples < k:
        raise ConfigError(f"--k must be >= 1 and --samples >= --k (got k={k}, samples={samples})")
    if samples > 1 and cfg.sampling.temperature == 0:  # pass@k would be pass@1, n times the cost
        raise ConfigError(f"--samples {samples} episodes a task at temperature 0 (greedy) play the same "
                          "episode over: give --temperature above 0 (or sampling.temperature), or --k 1")
    # the env the training run evaluated on (its split, say), whether or not the env counts its
    # tasks: a counted one (the real ALFWorld) played its default split, not train.evaluation's
    evaluated = held_out.env_kwargs if split is None and held_out is not None and held_out_seeds(held_out) else {}
    kwargs = dict(cfg.env.kwargs) | ({"split": split} if split is not None else {}) | evaluated
    num_tasks, task_family, labels, max_steps = _read_split(env_id, kwargs, split)
    held = [] if num_tasks or held_out is None else held_out_seeds(held_out)
    ev = eval_config(cfg, samples, env_kwargs=kwargs)
    if num_tasks:
        seeds, counted_by = list(range(num_tasks)), ""
    elif held:
        seeds, counted_by = held, "train.evaluation's held-out tasks count them"
    else:
        seeds = [ev.rollout.seed + i for i in range(ev.rollout.episodes)]
        counted_by = "rollout.episodes counts them; give --episodes"
    if limit is not None and not num_tasks and limit > len(seeds):  # it only cuts: say what counts
        raise ConfigError(f"--limit {limit} is above the {len(seeds)} tasks {env_id} plays: it does not "
                          f"say how many its split holds, so {counted_by}")
    if limit is not None:
        seeds = seeds[:limit]
    families = {s: task_family(s) for s in seeds} if task_family else {}
    held_out_tasks = bool(held) and not num_tasks  # played as the training run did: rollout.max_turns
    if "max_turns" not in ev.rollout.model_fields_set and isinstance(max_steps, int) and not held_out_tasks:
        ev.rollout.max_turns = max_steps  # the env's own limit ends the episode
    if split is None and isinstance(evaluated.get("split"), str):
        split = evaluated["split"]  # the report and its trees name the split train.evaluation gave
    return SplitPlan(env_id, split, k, samples, seeds, families, labels, ev, kwargs, num_tasks,
                     held_out=held_out_tasks, held_out_kwargs=bool(evaluated))


def evaluate_split(env_id: str, policy: Any, cfg: Config, split: str | None = None, k: int = 1,
                   samples: int | None = None, limit: int | None = None,
                   on_episode_done: Callable[[RolloutTree], None] | None = None,
                   on_start: Callable[[int], None] | None = None,
                   plan: SplitPlan | None = None) -> tuple[EvalReport, list[RolloutTree]]:
    """Evaluate ``policy`` on every task of ``split`` (see the module docstring).

    ``cfg.sampling.temperature`` is used as given (``agentrl eval`` sets 0 for greedy);
    ``cfg.rollout.episodes`` counts the tasks of an env without ``num_tasks``. ``plan``: the
    split as ``plan_split`` read it already (the other arguments but the callbacks are then
    its own). ``on_start(total_episodes)`` is called before the first episode. On Ctrl-C it
    raises ``RunInterrupted`` whose ``report`` covers the tasks that had finished (``interrupted``).
    """
    from .rollout import RunInterrupted, collect

    p = plan or plan_split(env_id, cfg, split, k, samples, limit)
    ev, seeds = p.cfg, p.seeds
    if on_start:
        on_start(len(seeds) * p.samples)
    t0 = time.perf_counter()
    try:
        trees, stop = collect(p.env_id, policy, ev, seeds, on_episode_done=on_episode_done), None
    except RunInterrupted as e:  # a report on the tasks that finished, said to be partial
        trees, stop = e.trees, e
    wall = time.perf_counter() - t0
    if p.split is not None:  # the trees of several splits share one file, and their seeds
        for tree in trees:
            tree.meta["split"] = p.split
    results = _task_results(trees, lambda s: p.families.get(s))
    reasons: dict[str, int] = {}
    for r in results:
        for e in r.errors:
            reason = e.split(":")[0][:80]
            reasons[reason] = reasons.get(reason, 0) + 1
    report = EvalReport(
        env=p.env_id, split=p.split, k=p.k, samples=p.samples, temperature=ev.sampling.temperature,
        tasks=len(seeds), rows=report_rows(results, p.k, p.labels), results=results, failure_reasons=reasons,
        wall_s=round(wall, 3),
        settings={"max_turns": ev.rollout.max_turns, "max_context_tokens": ev.rollout.max_context_tokens,
                  "max_new_tokens": ev.sampling.max_new_tokens, "show_admissible": ev.rollout.show_admissible,
                  "env_kwargs": {key: str(v) for key, v in p.kwargs.items()}},
        interrupted=stop is not None)
    if stop is not None:
        raise RunInterrupted(trees, report) from stop
    return report, trees
