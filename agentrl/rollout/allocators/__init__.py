"""Branch allocation: where a fixed rollout budget goes, across tasks, turns and tokens.

An allocator is sans-I/O (``base``: the requests, the state it sees, the
budget arithmetic). The engine (``agentrl.rollout.engine``) asks it for a
plan in rounds and runs the requests, until it returns none. The engine
enforces the budget: a ``leaves`` request that would overspend is clipped,
and ``turns``/``tokens`` budgets stop episodes when spent (truncation reason
``budget``), so no allocator can overspend even when its estimates are wrong.

The allocators, chosen by name from ``ALLOCATORS``, one module each, with its
paper, its rule and its plan:

    independent     n fresh episodes per task (GRPO)
    pilot_commit    pilots, then the rest in proportion to p(1-p) (AR3PO, AERO)
    entropy_branch  branch before turns whose entropy rose (ARPO, AEPO)
    segment_tree    fixed-width tree of turn segments (TreePO)
    key_state       branch before turns with a low top-1 probability (Spark)
    contrastive     branch points spread by path and depth decay (CBPO)

Each takes its options model (``agentrl.allocator_options``: what
``rollout.allocator`` validates to) and reads only the trees and the budget;
the state it keeps between rounds lives in the trees (``state.round`` says
where it is), so one allocator object serves every batch. What an allocator
decided goes to ``state.report[name]``.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from ...allocator_options import OPTIONS, AllocatorOptions, IndependentOptions, allocator_spec
from ...errors import ConfigError
from .base import (
    Allocator,
    AllocState,
    Branch,
    Budget,
    Fresh,
    affordable_leaves,
    fill_evenly,
    fresh_costs,
    is_open,
    largest_remainder,
    leaf_cost,
    most_leaves,
    priced_fill,
)
from .contrastive import Contrastive, contrastive_branch_points, prefix_groups
from .entropy_branch import EntropyBranch, entropy_branch_scores
from .independent import Independent
from .key_state import KeyState, key_states
from .pilot_commit import PilotCommit, pilot_commit_split
from .segment_tree import SegmentTree, segment_children

if TYPE_CHECKING:
    from ...config import RolloutConfig

__all__ = [
    "ALLOCATORS",
    "OPTIONS",
    "AllocState",
    "Allocator",
    "AllocatorOptions",
    "Branch",
    "Budget",
    "Contrastive",
    "EntropyBranch",
    "Fresh",
    "Independent",
    "IndependentOptions",
    "KeyState",
    "PilotCommit",
    "SegmentTree",
    "affordable_leaves",
    "contrastive_branch_points",
    "entropy_branch_scores",
    "fill_evenly",
    "fresh_costs",
    "is_open",
    "key_states",
    "largest_remainder",
    "leaf_cost",
    "make_allocator",
    "most_leaves",
    "options_for",
    "pilot_commit_split",
    "prefix_groups",
    "priced_fill",
    "rollout_allocator",
    "segment_children",
]

ALLOCATORS: dict[str, type[Independent | PilotCommit | EntropyBranch | SegmentTree | KeyState | Contrastive]] = {
    "independent": Independent,
    "pilot_commit": PilotCommit,
    "entropy_branch": EntropyBranch,
    "segment_tree": SegmentTree,
    "key_state": KeyState,
    "contrastive": Contrastive,
}
"""Every allocator, by the name ``rollout.allocator`` uses; its options model is ``OPTIONS[name]``."""


def options_for(name: str, **options: Any) -> AllocatorOptions:
    """The options model of allocator ``name``, validated. Raises ``ConfigError`` (a
    ``ValueError``) naming an unknown allocator, or a bad option and what it must be."""
    try:
        model = OPTIONS[allocator_spec(name)["name"]]
    except ValueError as e:  # an unknown name
        raise ConfigError(str(e)) from None
    try:
        return model.model_validate(options)  # type: ignore[return-value]
    except ValidationError as e:
        raise ConfigError(f"allocator {name}: " + "; ".join(_reason(model, err) for err in e.errors())) from None


def _reason(model: type[BaseModel], err: Any) -> str:
    """One pydantic error as the option it names and what to do (did-you-mean on a typo)."""
    key = ".".join(map(str, err["loc"]))
    if err["type"] != "extra_forbidden":
        return f"option {key!r}: {err['msg']}"
    valid = [k for k in model.model_fields if k != "name"]
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown option {key!r}{hint}; valid options: {', '.join(valid)}"


def make_allocator(spec: str | AllocatorOptions, /, **options: Any) -> Allocator:
    """The allocator ``spec`` names with ``options`` (fields of its options model), or
    the one an options model (``cfg.rollout.allocator``) describes. Raises
    ``ConfigError`` as ``options_for`` does."""
    if isinstance(spec, str):
        spec = options_for(spec, **options)
    elif options:
        raise TypeError("make_allocator: give options with a name, or an options model alone")
    return ALLOCATORS[spec.name](spec)  # type: ignore[arg-type]


def rollout_allocator(rollout: RolloutConfig, name: str | None = None) -> Allocator:
    """The allocator ``rollout.allocator`` configures; ``name``: that allocator instead,
    with its default options unless it is the configured one. An independent allocator
    whose ``n`` is null plays ``rollout.group_size`` episodes per task."""
    options = rollout.allocator
    if name is not None and name != options.name:
        options = options_for(name)
    if isinstance(options, IndependentOptions) and options.n is None:
        options = options.model_copy(update={"n": rollout.group_size})
    return make_allocator(options)
