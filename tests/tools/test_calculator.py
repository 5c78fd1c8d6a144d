"""The calculator: right answers, and attacks that end as errors, never crashes or hangs."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.tools import CalculatorTool
from agentrl.tools.calculator import CalcError, evaluate


def calc(expr: str):
    return asyncio.run(CalculatorTool().invoke({"expression": expr}, None))


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("sqrt(16) + abs(-2)", "6"),
        ("round(pi, 3)", "3.142"),
        ("factorial(5)", "120"),
        ("max(3, 9, 4) - min(1, 2)", "8"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.3"),
    ],
)
def test_calculator_computes(expr, want):
    res = calc(expr)
    assert not res.is_error, res.content
    assert res.content == want


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("9 ** 9 ** 9", "too large"),
        ("3 ** 4000", "bits"),
        ("2 ** 100000", "too large"),
        ("10 ** 10 ** 10", "too large"),
        ("factorial(100000)", "factorial is limited"),
        ("(1).__class__", "Attribute"),
        ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
        ("__import__('os').system('echo hi')", "not allowed"),
        ("__import__('os')", "not an allowed function"),
        ("eval('1')", "not an allowed function"),
        ("x + 1", "unknown name 'x'"),
        ("lambda: 1", "Lambda"),
        ("[i for i in range(10**9)]", "not allowed"),
        ("'a' * 10", "only numbers"),
        ("1 / 0", "division by zero"),
        ("2 ^ 10", "write **"),
        ("1 << 100000", "not allowed"),
        ("exp(1000)", "cannot compute"),
        ("(-8) ** 0.5", "not a real number"),
        ("sqrt(-1)", "cannot compute"),
        ("1 +", "not a valid expression"),
        ("(" * 300 + "1" + ")" * 300, "not a valid expression"),
        ("-" * 900 + "1", "nested"),
        ("1" * 2000, "longer than"),
        ("True + 1", "only numbers"),
        ("round(1.5, ndigits=2)", "keyword"),
    ],
)
def test_calculator_refuses_attacks_with_an_error(expr, reason):
    res = calc(expr)
    assert res.is_error
    assert res.content.startswith("calculator error:")
    assert reason in res.content


def test_repeated_squaring_is_bounded():
    expr = "((((((2**64)**2)**2)**2)**2)**2)**2"
    with pytest.raises(CalcError, match="bits"):
        evaluate(expr)


@settings(deadline=None, max_examples=200)
@given(st.text(max_size=80))
def test_calculator_never_raises_on_arbitrary_text(expr):
    res = calc(expr)
    assert isinstance(res.content, str)
