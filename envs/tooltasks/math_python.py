"""``agentrl/MathPython-v0``: generated arithmetic and word problems with numeric answers.

The model may use the ``python`` tool (a persistent interpreter in the sandbox)
and the ``calculator``, and ends with ``Answer: <number>``. Reward 1.0 when the
number matches the reference (exactly for integers, within a cent for money),
else 0.0. Problems come from a handful of templates filled from the episode's
seed; several (counting primes, digit sums of big powers) are easy with code and
tedious by hand.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from agentrl.tools import Task

from .._settings import names
from ._common import extract_answer, numbers_match
from .base import ToolTaskEnv

__all__ = ["MathPythonEnv", "make_math_task"]

SUFFIX = " Give your final answer on its own line as 'Answer: <number>'."
NAMES = ["Maya", "Omar", "Lena", "Ravi", "Sofia", "Ken", "Ada", "Tomas", "Iris", "Juan"]
ITEMS = ["notebooks", "pens", "mugs", "lamps", "tickets", "plants"]


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, math.isqrt(n - 1) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return sum(sieve)


def _arith(r: random.Random) -> tuple[str, float, float]:
    a, b, c, d = r.randint(100, 999), r.randint(100, 999), r.randint(1000, 9999), r.randint(7, 97)
    return f"Compute ({a} * {b} - {c}) mod {d}.", float((a * b - c) % d), 0.0


def _squares(r: random.Random) -> tuple[str, float, float]:
    n = r.randint(20, 400)
    return (
        f"What is the sum of the squares of the integers from 1 to {n}?",
        float(n * (n + 1) * (2 * n + 1) // 6),
        0.0,
    )


def _primes(r: random.Random) -> tuple[str, float, float]:
    n = r.randint(100, 20_000)
    return f"How many prime numbers are smaller than {n}?", float(_primes_below(n)), 0.0


def _digit_sum(r: random.Random) -> tuple[str, float, float]:
    a, b = r.randint(2, 9), r.randint(40, 200)
    return (
        f"What is the sum of the decimal digits of {a}**{b}?",
        float(sum(map(int, str(a**b)))),
        0.0,
    )


def _lcm(r: random.Random) -> tuple[str, float, float]:
    a, b, c = (r.randint(6, 120) for _ in range(3))
    return f"What is the least common multiple of {a}, {b} and {c}?", float(math.lcm(a, b, c)), 0.0


def _shop(r: random.Random) -> tuple[str, float, float]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    price, n, off = r.randint(150, 4_999) / 100, r.randint(2, 12), r.choice([5, 10, 15, 20, 25])
    total = round(price * n * (100 - off) / 100, 2)
    paid = (math.floor(total / 20) + 1) * 20
    q = (
        f"{name} buys {n} {item} at ${price:.2f} each and gets a {off}% discount on the total. "
        f"{name} pays with ${paid}. How much change, in dollars, does {name} get?"
    )
    return q, round(paid - total, 2), 0.011


def _interest(r: random.Random) -> tuple[str, float, float]:
    p, rate, years = r.randint(10, 200) * 100, r.choice([2, 3, 4, 5, 6, 7]), r.randint(2, 15)
    amount = round(p * (1 + rate / 100) ** years, 2)
    q = (
        f"${p} is invested at {rate}% interest compounded yearly. What is it worth after "
        f"{years} years, in dollars, rounded to the cent?"
    )
    return q, amount, 0.011


def _trip(r: random.Random) -> tuple[str, float, float]:
    d1, v1, d2, v2 = r.randint(10, 300), r.randint(30, 120), r.randint(10, 300), r.randint(30, 120)
    minutes = round((d1 / v1 + d2 / v2) * 60, 2)
    q = (
        f"A train covers {d1} km at {v1} km/h, then {d2} km at {v2} km/h. How many minutes "
        "does the whole trip take, rounded to two decimals?"
    )
    return q, minutes, 0.011


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, float, float]]] = {
    "arith": _arith,
    "squares": _squares,
    "primes": _primes,
    "digit_sum": _digit_sum,
    "lcm": _lcm,
    "shop": _shop,
    "interest": _interest,
    "trip": _trip,
}


def make_math_task(rng: np.random.Generator, kinds: tuple[str, ...] = tuple(TEMPLATES)) -> Task:
    """One problem drawn from ``kinds`` with the generator ``rng``."""
    r = random.Random(int(rng.integers(2**63 - 1)))
    kind = r.choice(kinds)
    question, answer, tol = TEMPLATES[kind](r)

    def verify(text: str) -> float:
        return float(numbers_match(extract_answer(text), answer, tolerance=max(tol, 1e-6)))

    return Task(question + SUFFIX, verify=verify, info={"reference": answer, "kind": kind})


class MathPythonEnv(ToolTaskEnv):
    """Numeric problems solved with the ``python`` and ``calculator`` tools.

    ``sandbox`` is where ``python`` runs: a backend name (default ``"auto"``:
    the strongest backend this machine has, see ``make_sandbox``), a
    ``Sandbox``, a factory or a pool.
    """

    def __init__(self, sandbox: Any = "auto", kinds: tuple[str, ...] | None = None, **config: Any):
        # None is every kind; an empty list is refused (it played every kind, silently)
        self.kinds = names("kinds", kinds, TEMPLATES) if kinds is not None else tuple(TEMPLATES)
        config.setdefault("max_turns", 8)
        super().__init__(
            lambda rng: make_math_task(rng, self.kinds), ["python", "calculator"], sandbox, **config
        )
