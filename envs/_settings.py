"""Checks of the settings a built-in env is made with.

Each check returns the value as the env keeps it, or raises ``EnvError`` naming
the setting and the value it was given, the way a bad config names its key.
Python's own errors named neither (``high="32"`` raised "'<' not supported
between instances of 'str' and 'int'"), some values failed only at reset
(``high=3.5``), and some were taken in a sense nobody meant: ``dense_reward="no"``
is truthy, ``max_steps=2.5`` ran three steps, ``kinds="arith"`` was five letters.

``reset_options`` checks the options of one reset the same way: a misspelt
option was ignored, and another task than the one asked for was played.

A bool is not a whole number here (``True`` would be a budget of 1 step), a str
is not a flag, and a lone str where names are listed is one name.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from agentrl.errors import EnvError

__all__ = ["flag", "names", "number", "one_of", "path_or_none", "reset_options", "whole"]


def _bounds(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" between {low:,} and {high:,}"
    if low is not None:
        return f" >= {low:,}"
    return f" <= {high:,}" if high is not None else ""


def whole(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` (numpy's integers too) within ``[low, high]``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        raise EnvError(f"{name} must be a whole number{_bounds(low, high)}, not {value!r:.80}")
    return int(value)


def number(name: str, value: Any, low: float | None = None) -> float:
    """``value`` as a finite ``float``, at least ``low``: a NaN would reach every advantage."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if not ok or not math.isfinite(value) or (low is not None and value < low):
        raise EnvError(f"{name} must be a finite number{_bounds(low, None)}, not {value!r:.80}")
    return float(value)


def flag(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: only True or False (numpy's too)."""
    if not isinstance(value, bool | np.bool_):
        raise EnvError(f"{name} must be true or false, not {value!r:.80}")
    return bool(value)


def one_of(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value``, which must be one of ``choices``."""
    choices = tuple(choices)
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise EnvError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r:.80}")
    return value


def names(name: str, value: Any, known: Iterable[str]) -> tuple[str, ...]:
    """``value`` as a non-empty tuple of names from ``known``; a lone str is one name."""
    known = tuple(known)
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items or not all(isinstance(v, str) for v in items):
        raise EnvError(f"{name} must be a list of some of {', '.join(known)}, not {value!r:.80}")
    if unknown := sorted(set(items) - set(known)):
        raise EnvError(f"{name}: unknown {', '.join(map(repr, unknown))} in {value!r:.80}; "
                       f"use some of {', '.join(known)}")
    return tuple(items)


def path_or_none(name: str, value: Any) -> str | os.PathLike | None:
    """``value``, which must be a str, an ``os.PathLike`` or None."""
    if value is not None and not isinstance(value, str | os.PathLike):
        raise EnvError(f"{name} must be a folder path or None, not {value!r:.80}")
    return value


def reset_options(options: Any, known: Iterable[str]) -> dict[str, Any]:
    """``options`` of ``reset`` (None: none) as a dict whose keys are all in ``known``."""
    known = tuple(sorted(known))
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise EnvError(f"reset options must be a dict, not {options!r:.80}")
    if unknown := sorted(set(options) - set(known), key=repr):
        takes = f"takes {', '.join(map(repr, known))}" if known else "takes none"
        raise EnvError(f"unknown reset option {', '.join(f'options[{k!r}]' for k in unknown)}: "
                       f"this env {takes}")
    return options
