"""Credit method options: one pydantic model per credit method, the ``train.credit`` key.

``train.credit`` names a credit method and sets its options in one mapping,
``{name: gigpo, gamma: 0.95, omega: 1.0}``; a plain name (``grpo``) is that
method with its default options, and ``none`` is no RL advantage at all
(distillation only). ``CreditOptions`` is the union of the models, told apart
by ``name``. A bad option fails when the config loads, naming its key path
(``train.credit.gamma``).

The models live outside ``agentrl.credit`` so that the config can validate
them without importing numpy-heavy code; ``agentrl.credit.ESTIMATORS`` pairs
each method with its model. Defaults equal those of the pure functions in
``agentrl.credit`` (``grpo``, ``gigpo_advantages``, ...), whose docstrings
name the paper and equation. Callables (``gdpo``'s ``reward_fn``, ``gae``'s
``value_fn``, an ``outcome`` function) cannot come from a config: they are
keyword arguments of ``agentrl.credit.assign`` only.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import Field

from .strict import StrictOptions

__all__ = [
    "CREDIT_OPTIONS",
    "CreditMethodOptions",
    "CreditOptions",
    "DrGRPOOptions",
    "GAEOptions",
    "GDPOOptions",
    "GRPOOptions",
    "GiGPOOptions",
    "MCGRPOOptions",
    "NoCreditOptions",
    "RLOOOptions",
    "ReturnsOptions",
    "TreeOptions",
    "credit_spec",
    "recorded_credit",
]

_EPS = "Added to the std before dividing, so an all-equal group gets 0, not NaN."
_OUTCOME = ("What an episode scores for the comparison: return (the sum of its rewards) or success "
            "(1 when it succeeded, else 0).")
_SCALE = "Divide by the group's sample std (std) or not (none)."
_LEVEL = ("Whitening of the per-turn values (agentrl.credit.normalize): over each turn index (turn), "
          "each group (group), the batch (batch), the mean of group and batch (mixed); null: none.")
_CODE_ONLY = ("value_fn", "reward_fn")  # callables: keyword arguments of agentrl.credit.assign only


class CreditMethodOptions(StrictOptions):
    """The options of one credit method: unknown keys, non-finite numbers (omega: .inf made
    every advantage NaN) and bools for numbers (eps: true) are errors."""

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of the method's function: every option but ``name`` and ``outcome``
        (which the dispatch reads itself)."""
        return self.model_dump(exclude={"name", "outcome"})


def _outcome() -> Any:
    return Field("return", description=_OUTCOME)


def _eps() -> Any:
    return Field(1e-6, ge=0, description=_EPS)


def _gamma(default: float, what: str) -> Any:
    return Field(default, ge=0, le=1, description=f"Discount per turn of {what}.")


class GRPOOptions(CreditMethodOptions):
    """`grpo`: ``(r - mean) / (std + eps)`` over the episodes of a group (DeepSeekMath, Sec. 4.1.2)."""

    name: Literal["grpo"] = Field("grpo", description="Credit method name.")
    outcome: Literal["return", "success"] = _outcome()
    eps: float = _eps()


class DrGRPOOptions(CreditMethodOptions):
    """`dr_grpo`: ``r - mean`` over the episodes of a group, no std (Liu et al. 2025, Dr. GRPO)."""

    name: Literal["dr_grpo"] = Field("dr_grpo", description="Credit method name.")
    outcome: Literal["return", "success"] = _outcome()


class RLOOOptions(CreditMethodOptions):
    """`rloo`: ``r_i`` minus the mean of the other episodes of its group (Kool et al. 2019)."""

    name: Literal["rloo"] = Field("rloo", description="Credit method name.")
    outcome: Literal["return", "success"] = _outcome()


class MCGRPOOptions(CreditMethodOptions):
    """`mc_grpo`: the group's median as the baseline; the median episode of an odd group carries
    no gradient (Kim 2026, MC-GRPO)."""

    name: Literal["mc_grpo"] = Field("mc_grpo", description="Credit method name.")
    outcome: Literal["return", "success"] = _outcome()
    scale: Literal["std", "none"] = Field("std", description=_SCALE)
    eps: float = _eps()


class GiGPOOptions(CreditMethodOptions):
    """`gigpo`: episode advantage plus ``omega`` times the step advantage among the steps taken in
    the same anchor state (Feng et al. 2025, GiGPO, Sec. 4)."""

    name: Literal["gigpo"] = Field("gigpo", description="Credit method name.")
    gamma: float = _gamma(0.95, "the step-level returns")
    omega: float = Field(1.0, ge=0, description="Weight of the step-level (anchor state) advantage.")
    scale: Literal["std", "none"] = Field("std", description=_SCALE)
    eps: float = _eps()
    similarity: float | None = Field(
        None, gt=0, le=1, description="Observation texts at least this similar (difflib ratio) share "
        "an anchor state (verl-agent uses 0.95); null: only equal state keys do.")


class TreeOptions(CreditMethodOptions):
    """`tree`: a node's value is the mean outcome of the leaves below it; its advantage mixes the
    gain over the root and over its parent (TreeRL; contrastive sibling scaling)."""

    name: Literal["tree"] = Field("tree", description="Credit method name.")
    outcome: Literal["return", "success"] = _outcome()
    global_weight: float = Field(1.0, description="Weight of V(n) - V(root).")
    local_weight: float = Field(1.0, description="Weight of V(n) - V(parent).")
    leaf_norm: Literal["sqrt", "none"] = Field(
        "sqrt", description="Divide a node's advantage by the square root of its leaf count (sqrt) or not.")
    contrastive: bool = Field(False, description="Divide each sibling set's advantages by the std of "
                              "their values, clamped to [1, max_scale].")
    max_scale: float = Field(10.0, ge=1, description="Largest factor of the contrastive scaling.")
    eps: float = Field(1e-6, ge=0, description="Added to the siblings' std before dividing.")


class GDPOOptions(CreditMethodOptions):
    """`gdpo`: each reward normalised within its group, then summed with weights and renormalised
    over the batch (Liu et al. 2026, GDPO). Needs ``reward_fn``, a keyword of ``assign`` only."""

    name: Literal["gdpo"] = Field("gdpo", description="Credit method name.")
    weights: dict[str, float] | list[float] | None = Field(
        None, description="Weight of each reward, by name or by position; null: all 1.")
    batch_norm: bool = Field(True, description="Renormalise the weighted sums over the whole batch.")
    eps: float = _eps()


class ReturnsOptions(CreditMethodOptions):
    """`returns`: the discounted return from each turn on (Sutton & Barto 2018, eq. 3.9), whitened."""

    name: Literal["returns"] = Field("returns", description="Credit method name.")
    gamma: float = _gamma(1.0, "the returns")
    level: Literal["turn", "group", "batch", "mixed"] | None = Field("group", description=_LEVEL)


class GAEOptions(CreditMethodOptions):
    """`gae`: generalised advantage estimation over turns (Schulman et al. 2016, eq. 16) with the
    value head of ``train.value_head``, whitened; without a value head, the discounted returns (lam unused)."""

    name: Literal["gae"] = Field("gae", description="Credit method name.")
    gamma: float = _gamma(1.0, "the TD errors")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda: 1 is the Monte Carlo return minus V, "
                       "0 the one-step TD error.")
    level: Literal["turn", "group", "batch", "mixed"] | None = Field("group", description=_LEVEL)


class NoCreditOptions(CreditMethodOptions):
    """`none`: no RL advantage; the step learns from distillation only (needs ``train.distill``)."""

    name: Literal["none"] = Field("none", description="Credit method name.")


_MODELS = (GRPOOptions, DrGRPOOptions, RLOOOptions, MCGRPOOptions, GiGPOOptions, TreeOptions,
           GDPOOptions, ReturnsOptions, GAEOptions)

CREDIT_OPTIONS: dict[str, type[CreditMethodOptions]] = {m.model_fields["name"].default: m for m in _MODELS}
"""Each credit method's options model, by the name a config uses (``none`` is not a method)."""

_NAMES = (*CREDIT_OPTIONS, "none")

CreditOptions = Annotated[
    GRPOOptions | DrGRPOOptions | RLOOOptions | MCGRPOOptions | GiGPOOptions | TreeOptions
    | GDPOOptions | ReturnsOptions | GAEOptions | NoCreditOptions,
    Field(discriminator="name"),
]


def credit_spec(value: Any) -> Any:
    """``train.credit`` as the mapping the union validates: a plain name is that method with
    default options. Raises ``ValueError`` on an unknown or missing name (with the closest
    valid one), or on a callable option a config cannot hold."""
    spec = {"name": value} if isinstance(value, str) else value
    if not isinstance(spec, dict):
        return spec  # a model already, or a wrong type the union reports
    name = spec.get("name")
    if name is None:
        raise ValueError(f"name the credit method: {{name: gigpo, ...}}; valid: {', '.join(_NAMES)}")
    if name not in _NAMES:
        close = difflib.get_close_matches(str(name), _NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown credit method {name!r}{hint}; valid: {', '.join(_NAMES)}")
    for key in _CODE_ONLY:
        if key in spec:
            fix = "set train.value_head" if key == "value_fn" else "pass it to agentrl.credit.assign in code"
            raise ValueError(f"{key} cannot come from a config: {fix}")
    return spec


def recorded_credit(train: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, options) from a run's recorded ``train`` section (a config's JSON dump): the
    current form, ``credit: {name: ..., ...}`` or a plain name, and the form of runs recorded
    before it, ``credit: NAME`` beside ``credit_options``. ``grpo`` (the default) when absent."""
    got = train.get("credit") or "grpo"
    if isinstance(got, dict):
        return str(got.get("name") or "grpo"), {k: v for k, v in got.items() if k != "name"}
    return str(got), dict(train.get("credit_options") or {})
