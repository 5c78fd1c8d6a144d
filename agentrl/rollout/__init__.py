"""Rollouts: the async engine, tree branching, branch allocators, and summaries.

``collect(env_id, policy, cfg, seeds)`` grows one ``RolloutTree`` per task
seed; ``run_episodes`` is the same for ``cfg.rollout.episodes`` tasks.

Modules, one job each: ``engine`` (rounds of an allocator's plan, run
concurrently), ``episodes`` (one path played turn by turn), ``turns`` (an env
step as a tree node), ``budget`` (what a run has spent), ``executors`` and
``env_process`` (where env calls run), ``pool`` (the step threads), ``tree``
(branch points and segment splits), ``allocators`` (where the budget goes),
``summary`` (a run's numbers).
"""

from .allocators import (
    ALLOCATORS,
    Allocator,
    AllocState,
    Branch,
    Budget,
    Fresh,
    make_allocator,
    prefix_groups,
    rollout_allocator,
)
from .engine import Engine, RunInterrupted, collect, run_episodes
from .episodes import COUNTERS
from .summary import episode_success, make_out_dir, summarize, write_run
from .tree import BranchPoint, format_tree, split_node

__all__ = [
    "ALLOCATORS",
    "COUNTERS",
    "AllocState",
    "Allocator",
    "Branch",
    "BranchPoint",
    "Budget",
    "Engine",
    "Fresh",
    "RunInterrupted",
    "collect",
    "episode_success",
    "format_tree",
    "make_allocator",
    "make_out_dir",
    "prefix_groups",
    "rollout_allocator",
    "run_episodes",
    "split_node",
    "summarize",
    "write_run",
]
