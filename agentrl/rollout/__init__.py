"""Rollouts: the async engine, tree branching, branch allocators, and summaries.

``collect(env_id, policy, cfg, seeds)`` grows one ``RolloutTree`` per task
seed; ``run_episodes`` is the same for ``cfg.rollout.episodes`` tasks.
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
from .engine import COUNTERS, Engine, collect, run_episodes
from .summary import episode_success, summarize, write_run
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
    "collect",
    "episode_success",
    "format_tree",
    "make_allocator",
    "prefix_groups",
    "rollout_allocator",
    "run_episodes",
    "split_node",
    "summarize",
    "write_run",
]
