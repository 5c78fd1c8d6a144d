"""What a run does, decided by its config alone: each step's task seeds and the plan.

The step is the data position (``step_task_seeds``), so a resumed run trains
on the same tasks; ``run_plan`` is what a dry run (``train.steps: 0``) prints.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from ..evaluation import held_out_seeds
from .compiled import compile_resolves_on
from .config import TrainConfig, TrainRunConfig
from .curriculum import describe
from .model import precision, resolved_precision

__all__ = ["held_out_overlaps", "print_plan", "run_plan", "start_warnings", "step_task_seeds",
           "unread_rollout_keys"]


def step_task_seeds(cfg: TrainConfig, step: int) -> list[int]:
    """The task seeds step ``step`` (0-based) trains on: the data position is the step."""
    n = cfg.tasks_per_step
    if cfg.task_seeds is not None:
        pool = cfg.task_seeds
        return [pool[(step * n + j) % len(pool)] for j in range(n)]
    return [cfg.task_seed_start + step * n + j for j in range(n)]


def unread_rollout_keys(cfg: TrainRunConfig, command: str) -> list[str]:
    """What ``agentrl train`` or ``agentrl sft`` (``command``) says about the keys of ``agentrl
    rollout`` that the config sets and the run does not read, each with the key it reads
    instead; [] where none is set. One file serves every command, so those keys are no error,
    but a user who set ``rollout.seed`` to pick the tasks would otherwise train on others."""
    r, t, s = cfg.rollout, cfg.train, cfg.sft
    given = r.model_fields_set
    if command == "sft":
        tasks = f"its expert episodes play task seeds from sft.seed_start={s.seed_start} (or sft.task_seeds)"
        count = f"it plays sft.episodes={s.episodes} expert episodes (or sft.task_seeds, sft.levels)"
    else:
        tasks = (f"step k trains on task seeds from train.task_seed_start={t.task_seed_start} + k * "
                 f"train.tasks_per_step (or train.task_seeds)")
        count = f"each of train.steps={t.steps} steps plays train.tasks_per_step={t.tasks_per_step} tasks"
    held_out = f"the held-out evaluation plays seeds from train.evaluation.seed_start={t.evaluation.seed_start}"
    said = []
    if "seed" in given:
        said.append(f"rollout.seed={r.seed} is not read by agentrl {command}: {tasks}, and {held_out}")
    if "episodes" in given:
        said.append(f"rollout.episodes={r.episodes} is not read by agentrl {command}: {count}; "
                    f"train.evaluation.episodes={t.evaluation.episodes} are held out")
    if "out_dir" in given:
        said.append(f"rollout.out_dir={r.out_dir} is not read by agentrl {command}: it writes to "
                    f"train.output.dir={t.output.dir}")
    return said


def _seeds(task_seeds: list[int] | None, start: int, count: int) -> set[int]:
    return set(task_seeds) if task_seeds is not None else set(range(start, start + count))


def held_out_overlaps(cfg: TrainRunConfig) -> list[str]:
    """What the run says when held-out task seeds (``train.evaluation``) are also trained on, by
    RL (``train.task_seed_start`` or ``train.task_seeds`` over ``train.steps``) or by SFT: the
    evaluation then measures training tasks. Only where both play the same env keywords (no
    ``train.evaluation.env_kwargs``; no curriculum stage or SFT level with its own), where one
    seed is one task."""
    t, s = cfg.train, cfg.sft
    ev = t.evaluation
    if ev.env_kwargs:
        return []
    held = _seeds(ev.task_seeds, ev.seed_start, ev.episodes)
    trained = {}
    if t.steps and not any(stage.env_kwargs for stage in t.curriculum):
        played = t.steps * t.tasks_per_step  # a pool of task_seeds is cycled: the first this many
        trained["RL training tasks (train.task_seed_start, train.task_seeds)"] = (
            set(t.task_seeds[:played]) if t.task_seeds is not None
            else set(range(t.task_seed_start, t.task_seed_start + played)))
    if s.enabled and not s.levels:
        trained["SFT expert tasks (sft.seed_start, sft.task_seeds)"] = _seeds(s.task_seeds, s.seed_start, s.episodes)
    return [f"{len(held & seeds)} of the {len(held)} held-out task seeds (train.evaluation) are {what}, "
            f"{sorted(held & seeds)[0]} first: eval/success measures tasks trained on; move "
            "train.evaluation.seed_start or train.evaluation.task_seeds away from them"
            for what, seeds in trained.items() if held & seeds]


def start_warnings(cfg: TrainRunConfig, command: str) -> list[str]:
    """What ``agentrl train`` or ``agentrl sft`` warns of before it runs."""
    return unread_rollout_keys(cfg, command) + held_out_overlaps(cfg)


def run_plan(cfg: TrainRunConfig) -> dict[str, Any]:
    """What a run of ``cfg`` does, in the numbers a user checks before starting it."""
    t, r = cfg.train, cfg.rollout
    source = (f"harness: {t.harness}" if t.harness is not None
              else f"engine, allocator {r.allocator.name} {r.allocator.model_dump(exclude={'name'}, exclude_unset=True) or ''}".strip())
    return {"env": cfg.env.id, "model": cfg.policy.model, "backend": cfg.policy.backend,
            "rollouts": source, "steps": t.steps, "tasks per step": t.tasks_per_step,
            "episodes per task": r.group_size,
            "budget per step": f"{r.budget} {r.budget_unit}" if r.budget else f"{t.tasks_per_step * r.group_size} leaves",
            "credit": f"{t.credit.name} {t.credit.model_dump(exclude={'name'}, exclude_unset=True) or ''}".strip(),
            "trainable": t.trainable, "lr": t.optimizer.lr,
            "precision": _precision(t.precision, cfg.policy.device),
            "compile": _compile(t.compile, t.precision, cfg.policy.device),
            "held-out episodes per eval": len(held_out_seeds(t.evaluation)), "output dir": t.output.dir,
            "trees saved per step": t.output.save_trees,
            **({"curriculum": describe(t.curriculum)} if t.curriculum else {}),
            **({"sft levels": describe(cfg.sft.levels)} if cfg.sft.levels else {})}


def _precision(name: str, device: str) -> str:
    try:
        return resolved_precision(name, device) + (f" ({name} on {device})" if name == "auto" else "")
    except RuntimeError as e:  # torch's error for an unknown device string; a bad override raises
        return f"{name} ({e})"


def _compile(value: bool | str, precision_name: str, device: str) -> str:
    if value != "auto":
        return "on" if value else "off"
    try:
        with precision(precision_name):
            on = compile_resolves_on(value, device)
    except RuntimeError as e:  # as in _precision
        return f"auto ({e})"
    return f"{'on' if on else 'off'} (auto on {device})"


def print_plan(console: Console, plan: dict[str, Any]) -> None:
    """``run_plan``'s numbers as a table (the dry run's output)."""
    from rich.table import Table

    table = Table(title="dry run (train.steps=0): the plan; nothing evaluated or written")
    table.add_column("")
    table.add_column("value")
    for k, v in plan.items():
        table.add_row(k, str(v))
    console.print(table)
