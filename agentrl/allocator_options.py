"""Branch allocator options: one pydantic model per allocator, the ``rollout.allocator`` key.

``rollout.allocator`` names an allocator and sets its options in one mapping,
``{name: segment_tree, depth: 4, width: 2}``; a plain name (``segment_tree``)
is that allocator with its default options. ``AllocatorOptions`` is the union
of the models, told apart by ``name``. A bad option fails when the config
loads, naming its key path (``rollout.allocator.depth``).

The models live outside ``agentrl.rollout`` so that ``agentrl.config`` can
validate them without importing the engine; each allocator in
``agentrl.rollout.allocators`` takes its model. How each rule works, and the
paper it follows, is in that allocator's module and in docs/algorithms.md.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from .strict import StrictOptions

__all__ = [
    "OPTIONS",
    "AllocatorOptions",
    "ContrastiveOptions",
    "EntropyBranchOptions",
    "IndependentOptions",
    "KeyStateOptions",
    "PilotCommitOptions",
    "SegmentTreeOptions",
    "allocator_spec",
    "recorded_allocator",
]

_EST_LEAF_COST = ("Turns or tokens one episode is guessed to cost until one has finished (turns and "
                  "tokens budgets; plans are made in leaves); null: 8 turns or 1024 tokens.")
_FRESH_FRACTION = "Share of the budget spent on fresh episodes in round 0; the branch round spends the rest."
_K = "Continuations per branch point."
_IN_TURN = ("Fork inside the chosen turn, before its {which} token among the first first_tokens, "
            "instead of before the turn: what branches a single-turn task.")


class _Options(StrictOptions):
    """An allocator's options: unknown keys, non-finite numbers (est_leaf_cost: .inf bought 0
    leaves, threshold: .nan never branched) and bools for numbers (depth: true) are errors."""


def _est_leaf_cost() -> Any:
    return Field(None, gt=0, description=_EST_LEAF_COST)


class IndependentOptions(_Options):
    """`independent`: n fresh episodes per task, in one round (GRPO)."""

    name: Literal["independent"] = Field("independent", description="Allocator name.")
    n: Annotated[int, Field(ge=1)] | Literal["all"] | None = Field(
        None, description="Episodes per task; null: rollout.group_size; all: the whole budget spread "
        "evenly over the tasks.")
    est_leaf_cost: float | None = _est_leaf_cost()

    @field_validator("n", mode="wrap")
    @classmethod
    def _one_reason(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One reason for a bad ``n``, not one per member of its union."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be an int >= 1, 'all' or null, got {value!r}") from None


class PilotCommitOptions(_Options):
    """`pilot_commit`: pilots per task, then the rest of the budget in proportion to p(1-p) (AR3PO, AERO)."""

    name: Literal["pilot_commit"] = Field("pilot_commit", description="Allocator name.")
    pilots: int = Field(2, ge=1, description="Pilot episodes per task in round 0.")
    min_per_task: int = Field(
        0, ge=0, description="Committed episodes a saturated task (pilot pass rate 0 or 1) still gets.")
    est_leaf_cost: float | None = _est_leaf_cost()


class EntropyBranchOptions(_Options):
    """`entropy_branch`: branch before the turns whose entropy rose most (ARPO, AEPO)."""

    name: Literal["entropy_branch"] = Field("entropy_branch", description="Allocator name.")
    fresh_fraction: float = Field(0.5, gt=0, le=1, description=_FRESH_FRACTION)
    threshold: float = Field(
        0.5, description="Rise in mean entropy (nats) over the episode's first turn that a turn must "
        "exceed to be branched before.")
    first_tokens: int = Field(8, ge=1, description="Action tokens at the start of a turn whose entropy is averaged.")
    penalty: float = Field(
        0.5, ge=0, le=1, description="Factor on a turn's score when the turn before it also scored "
        "above threshold (AEPO), so branches do not pile up along one path.")
    k: int = Field(2, ge=1, description=_K)
    in_turn: bool = Field(False, strict=True, description=_IN_TURN.format(which="highest-entropy"))
    est_leaf_cost: float | None = _est_leaf_cost()


class SegmentTreeOptions(_Options):
    """`segment_tree`: a fixed-width tree of turn segments per task (TreePO)."""

    name: Literal["segment_tree"] = Field("segment_tree", description="Allocator name.")
    depth: int = Field(4, ge=1, description="Levels of segments; a full tree has width ** depth leaves.")
    width: int = Field(2, ge=1, description="Ways each open leaf splits at the next level.")
    segment_turns: int = Field(1, ge=1, description="Turns in one segment.")
    est_leaf_cost: float | None = _est_leaf_cost()


class KeyStateOptions(_Options):
    """`key_state`: branch at decision states, where the policy's top-1 probability is low (Spark)."""

    name: Literal["key_state"] = Field("key_state", description="Allocator name.")
    k: int = Field(2, ge=1, description=_K)
    top1_threshold: float = Field(
        0.5, gt=0, le=1, description="A turn whose first tokens have a mean top-1 probability below "
        "this is a key state.")
    first_tokens: int = Field(4, ge=1, description="Action tokens at the start of a turn whose top-1 probability is averaged.")
    fresh_fraction: float = Field(0.5, gt=0, le=1, description=_FRESH_FRACTION)
    in_turn: bool = Field(False, strict=True, description=_IN_TURN.format(which="lowest top-1"))
    est_leaf_cost: float | None = _est_leaf_cost()


class ContrastiveOptions(_Options):
    """`contrastive`: branch points spread over paths and depths by decay (CBPO)."""

    name: Literal["contrastive"] = Field("contrastive", description="Allocator name.")
    k: int = Field(2, ge=1, description=_K)
    path_decay: float = Field(
        0.5, gt=0, le=1, description="Weight factor per branch point already on a candidate's path.")
    node_decay: float = Field(
        0.5, gt=0, le=1, description="Weight factor per branch point already at a candidate's depth.")
    fresh_fraction: float = Field(0.5, gt=0, le=1, description=_FRESH_FRACTION)
    est_leaf_cost: float | None = _est_leaf_cost()


_MODELS = (IndependentOptions, PilotCommitOptions, EntropyBranchOptions, SegmentTreeOptions,
           KeyStateOptions, ContrastiveOptions)

OPTIONS: dict[str, type[_Options]] = {m.model_fields["name"].default: m for m in _MODELS}
"""Each allocator's options model, by the name a config uses."""

AllocatorOptions = Annotated[
    IndependentOptions | PilotCommitOptions | EntropyBranchOptions | SegmentTreeOptions
    | KeyStateOptions | ContrastiveOptions,
    Field(discriminator="name"),
]


def allocator_spec(value: Any) -> Any:
    """``rollout.allocator`` as the mapping the union validates: a plain name is that
    allocator with default options. Raises ``ValueError`` on an unknown or missing name,
    with the closest valid one."""
    spec = {"name": value} if isinstance(value, str) else value
    if not isinstance(spec, dict):
        return spec  # a model already, or a wrong type the union reports
    name = spec.get("name")
    if name is None:
        raise ValueError(f"name the allocator: {{name: segment_tree, ...}}; valid: {', '.join(OPTIONS)}")
    if name not in OPTIONS:
        close = difflib.get_close_matches(str(name), OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown allocator {name!r}{hint}; valid: {', '.join(OPTIONS)}")
    return spec


def recorded_allocator(rollout: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(name, options) from a run's recorded ``rollout`` section (a config's JSON dump):
    the current form, ``allocator: {name: ..., ...}`` or a plain name, and the form of
    runs recorded before it, ``allocator: NAME`` beside ``allocator_options``."""
    got = rollout.get("allocator")
    if isinstance(got, dict):
        options = {k: v for k, v in got.items() if k != "name"}
        return (str(got["name"]) if got.get("name") else None), options
    return (str(got) if got else None), dict(rollout.get("allocator_options") or {})
