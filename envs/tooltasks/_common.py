"""Shared pieces of the tool tasks: answer extraction, scoring and the default sandbox."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from agentrl.sandboxes.base import Sandbox

__all__ = [
    "answer_f1",
    "extract_answer",
    "normalize_answer",
    "numbers_match",
    "owned_sandbox",
    "parse_number",
]

_ANSWER = re.compile(r"answer\s*[:=]\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def extract_answer(text: str) -> str:
    """The text after the last ``Answer:`` line, else the whole text, stripped."""
    found = _ANSWER.findall(text[-20_000:])
    out = found[-1] if found else text
    return out.strip().strip("*").strip()


def parse_number(text: str) -> float | None:
    """The first number in ``text`` ("$1,234.50" -> 1234.5), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return float(m.group().replace(",", ""))
    except ValueError:
        return None


def numbers_match(answer: str, reference: float, tolerance: float = 1e-6) -> bool:
    """Whether ``answer`` holds a number within ``tolerance`` (absolute, or relative
    for large references) of ``reference``."""
    value = parse_number(answer)
    if value is None:
        return False
    return abs(value - reference) <= max(tolerance, 1e-9 * abs(reference))


_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalization: lower case, no punctuation, articles or extra spaces."""
    text = text.lower().translate(_NO_PUNCTUATION)  # a set per character made 1 MB take 3 s
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of the normalized answers (SQuAD's definition)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def owned_sandbox(spec: Any) -> tuple[Any, Sandbox | None]:
    """(what to give ``ToolEnv(sandbox=...)``, the sandbox we created and must close).

    ``spec`` is a backend name ("auto", or any name ``make_sandbox`` knows), a
    ``Sandbox``, a factory or a pool; only a name makes a sandbox we own.
    """
    if not isinstance(spec, str):
        return spec, None
    from agentrl.sandboxes import make_sandbox

    box = make_sandbox(spec)
    return box, box
