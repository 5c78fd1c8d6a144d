"""The base of every config section: strict where pydantic is lax.

Unknown keys are errors, and assignments are validated. A float is finite: ``.inf`` passes
every ``ge``/``gt`` bound (``sampling.temperature: .inf`` sampled uniformly, ``lr: .inf``
trained to NaN), and where no limit is meant, the key takes null. A bool is not a number:
pydantic's lax mode reads true as 1 and false as 0, so YAML's ``episodes: yes`` ran one task.
Its own module so that the option models (credit, allocators, loss, distillation, value head)
share it with ``agentrl.config`` without importing the whole config.
"""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

__all__ = ["StrictModel", "StrictOptions"]


class StrictModel(BaseModel):
    """A config section: unknown keys, infinite or NaN floats and bools for numbers are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A key that also takes a bool keeps it."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (problem := _bool_problem(field.annotation, value)):
            raise ValueError(problem)
        return value


class StrictOptions(BaseModel):
    """``StrictModel`` for the options of a method picked by a ``name`` discriminator (credit,
    allocators), which pydantic lets no per-field validator touch: the bool check runs on the
    whole mapping, and its message names the key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if field is not None and (problem := _bool_problem(field.annotation, value)):
                    raise ValueError(f"{key}: {problem}")
        return data


def _bool_problem(annotation: Any, value: Any) -> str | None:
    """What is wrong with ``value`` where ``annotation`` takes a number and no bool, or None."""
    if not _is_bool_in_a_number(annotation, value):
        return None
    given = value if isinstance(value, bool) else next(v for v in value if isinstance(v, bool))
    where = "" if isinstance(value, bool) else f" in {value}"
    return f"expected a number, got {str(given).lower()}{where}"


def _is_bool_in_a_number(annotation: Any, value: Any) -> bool:
    """Whether ``value`` is a bool (or a list holding one) where ``annotation`` takes an int or
    a float (or a list of them) and no bool."""
    kinds = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    if bool in kinds:
        return False
    if isinstance(value, bool):
        return any(k in (int, float) for k in kinds)
    items = [get_args(k)[0] for k in kinds if get_origin(k) is list and get_args(k)]
    items = [get_args(k)[0] if get_origin(k) is Annotated else k for k in items]  # list[Seed]
    return isinstance(value, list) and any(isinstance(v, bool) for v in value) and any(
        k in (int, float) for k in items)
