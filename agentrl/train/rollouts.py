"""Where a run's trees come from: a step's rollouts, what the allocator did, the trees saved.

One job: the run's sampling side, as functions of the config. ``step_rollouts``
grows step k's trees (one per task seed of step k, from fresh sampling streams, at
the level of step k's curriculum stage);
``allocation_report`` folds a step's branching into the run summary; and
``save_trees`` writes the first trees of a step for the viewer. A
``RolloutSource`` (an agent harness) replaces the native engine in
``step_rollouts`` and in the held-out evaluation (``agentrl.evaluation``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from ..policy.base import request_seed
from ..rollout.budget import planned_episodes
from ..types import RolloutTree, write_trees
from .config import TrainRunConfig
from .curriculum import at_level, stage_at
from .plan import step_task_seeds

__all__ = ["CollectFn", "RolloutSource", "allocation_report", "drop_trees_after", "planned_episodes", "save_trees",
           "step_rollouts"]

# (env id, policy, config, task seeds, on_episode_done=...) -> one tree per seed
CollectFn = Callable[..., list[RolloutTree]]


class RolloutSource(Protocol):
    """Where a step's trees come from when not from the native engine (an agent harness:
    ``agentrl.proxy.rollouts.HarnessRollouts``): ``collect`` has ``agentrl.rollout.collect``'s
    signature, ``stats`` are logged with each step, ``close`` ends it with the run."""

    stats: dict[str, Any]

    def collect(self, env_id: str, policy: Any, cfg: Any, seeds: list[int],
                on_episode_done: Callable[..., None] | None = None) -> list[RolloutTree]: ...

    def close(self) -> None: ...


def _invalid(summary: dict, prefix: str) -> dict[str, float]:
    """``{prefix}/invalid_action_frac`` where the env reports invalid actions, else nothing."""
    frac = summary.get("invalid_action_frac")
    return {} if frac is None else {f"{prefix}/invalid_action_frac": frac}


def step_rollouts(run_cfg: TrainRunConfig, step: int, policy: Any, advance_bar: Callable[..., Any],
                  source: RolloutSource | None = None, max_turns: int | None = None,
                  extra_stats: dict[str, Any] | None = None) -> tuple[list[RolloutTree], dict[str, Any]]:
    """Step ``step``'s trees sampled by ``policy``, at most ``max_turns`` turns an episode if given,
    and the step's rollout stats. ``advance_bar(total, label)`` makes the bar each episode advances;
    ``extra_stats`` (a source's, rollout workers') are logged with them."""
    from ..rollout import collect, summarize

    stage = stage_at(run_cfg.train.curriculum, step)
    cfg = at_level(run_cfg, stage[1] if stage else None)  # a copy: this step's changes stay in it
    if stage and step > 0 and source is None:
        retire_finished_stage(run_cfg, step)
    cfg.rollout.seed = request_seed(run_cfg.train.seed, step)  # fresh sampling streams per step
    if max_turns is not None:
        cfg.rollout.max_turns = min(cfg.rollout.max_turns, max_turns)
    seeds = step_task_seeds(run_cfg.train, step)
    total = len(seeds) * cfg.rollout.group_size if source else planned_episodes(cfg.rollout, len(seeds))
    advance = advance_bar(total, f"step {step + 1}")
    t0 = time.perf_counter()
    trees = (source.collect if source else collect)(cfg.env.id, policy, cfg, seeds, on_episode_done=advance)
    s = summarize(trees, time.perf_counter() - t0)
    return trees, {**(extra_stats or {}), "rollout/success": s["success_rate"], "rollout/reward": s["mean_reward"],
                   "rollout/turns": s["mean_turns"], "rollout/episodes": s["episodes"],
                   "rollout/failed": s["failed_episodes"],
                   "rollout/rejected_requests": s["rejected_requests"],  # an allocator's bad plans
                   "rollout/action_tokens": s["action_tokens"], "time/rollout_s": s["wall_s"],
                   "rollout/env_steps": s["env_steps"],
                   "rollout/generated_tokens": s["generated_tokens"],
                   "data/first_task_seed": seeds[0], **_invalid(s, "rollout"),
                   **({"data/curriculum_stage": stage[0]} if stage else {})}


def retire_finished_stage(run_cfg: TrainRunConfig, step: int) -> bool:
    """At the first step of a curriculum stage, retire the env workers of the stage before
    (``agentrl.distributed.env_workers.retire_env_worker_pool``): stages follow the step number,
    so no engine asks for them again, and the idle pool kept is then the evaluation's. Not where
    the evaluation or the next stage plays the same env kwargs. Whether a pool was retired."""
    if run_cfg.rollout.env_executor != "ray":
        return False
    now, before = stage_at(run_cfg.train.curriculum, step), stage_at(run_cfg.train.curriculum, step - 1)
    if now is None or before is None or now[0] == before[0]:
        return False
    done, nxt = at_level(run_cfg, before[1]), at_level(run_cfg, now[1])
    if done.env.kwargs == nxt.env.kwargs:  # one pool for both (they differ in max_turns, say)
        return False
    from ..evaluation import held_out_seeds

    ev = run_cfg.train.evaluation
    if held_out_seeds(ev) and done.env.kwargs == {**run_cfg.env.kwargs, **ev.env_kwargs}:
        return False
    from ..distributed.env_workers import retire_env_worker_pool

    return retire_env_worker_pool(done)


def allocation_report(name: str, summary: dict[str, Any], step: int, trees: list[RolloutTree],
                      console: Console) -> dict[str, Any]:
    """Fold what allocator ``name`` did this step into the run's ``summary``, and warn when a tree
    allocator made no branch: its budget then went to fresh episodes, as ``independent`` would."""
    from ..rollout import ALLOCATORS

    branches = sum(len(n.children) > 1 for t in trees for n in t.nodes.values())
    a = summary
    a["allocator"], a["steps"] = name, a.get("steps", 0) + 1
    a["branch_points"] = a.get("branch_points", 0) + branches
    a["last_report"] = trees[0].meta.get("allocation_report", {}) if trees else {}
    if ALLOCATORS[name].needs_snapshots and branches == 0:  # a tree allocator: it branches
        a["steps_without_branch"] = a.get("steps_without_branch", 0) + 1
        console.print(
            f"[yellow]warning:[/] step {step + 1}: allocator {name!r} made no branch "
            f"(report: {a['last_report'].get(name, {})}): every leaf is a fresh episode. A branch "
            "needs a turn to branch before; on single-turn tasks set "
            "rollout.allocator.in_turn=true (key_state, entropy_branch) to fork inside a turn.",
            highlight=False)
    return {"rollout/branch_points": branches}


def drop_trees_after(out: Path, step: int) -> list[Path]:
    """Remove the saved trees of steps after ``step`` (a run resumed there, or started over at 0),
    as ``metrics.jsonl`` drops their rows: the viewer would show an abandoned run's later steps
    beside the resumed run's. Returns the files removed."""
    gone = []
    for path in sorted((out / "trees").glob("step-*.jsonl")):
        number = path.stem.removeprefix("step-")
        if number.isdigit() and int(number) > step:
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


def save_trees(out: Path, n: int, step: int, trees: list[RolloutTree]) -> None:
    """The step's first ``n`` trees (``train.output.save_trees``), as the viewer and ``agentrl tree`` read them.

    Written after the step's update, so each carries ``meta["token_values"]``:
    the per-token values the update used (``agentrl.train.token_values``).
    """
    if n == 0:
        return
    folder = out / "trees"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.jsonl"
    tmp = folder / f".{path.name}.tmp"
    write_trees(tmp, trees[:n])
    tmp.replace(path)  # a resumed run redoes the step: the file is replaced whole
