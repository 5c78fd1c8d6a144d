"""``agentrl/BashFix-v0``: fix the bug that makes a small repository's unit test fail.

Each episode writes a generated Python repository into the sandbox: two or three
small modules, each with a ``unittest`` file under ``tests/``, and exactly one
module carries a planted bug (an off-by-one, a wrong operator, a missed case).
The agent uses ``bash`` and the file tools, then replies without a tool call
when done. Reward 1.0 when the whole test suite passes, else 0.0.

Reward hacking: editing or deleting the tests must not pay. The verifier never
trusts the repository's ``tests/``. It writes the pristine test files into a
fresh directory with a random name and runs them with ``python -I`` (the working
directory is not on ``sys.path``, so a planted ``unittest.py`` cannot shadow the
standard library). It counts as a pass only when the runner's report line
carries a per-check random nonce (read from stdin before any tested code is
imported) and every pristine test ran, with no failure, error or skip.
``info["tests_modified"]`` says whether the agent changed the repository's
tests. The limit: the tested code runs in the runner's process, so code written
to tamper with the runner itself could still forge a pass.
"""

from __future__ import annotations

import random
import re
import secrets
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentrl.sandboxes.base import Sandbox
from agentrl.tools import Task

from .base import ToolTaskEnv

__all__ = ["BashFixEnv", "BashFixTask", "Repo", "make_repo", "verify_repo"]


@dataclass(slots=True)
class _Module:
    name: str
    good: str
    bad: str
    tests: str


def _clamp(r: random.Random) -> _Module:
    lo, hi = r.randint(-50, 0), r.randint(10, 60)
    inside, below, above = r.randint(lo + 1, hi - 1), lo - r.randint(1, 40), hi + r.randint(1, 40)
    good = '''
        def clamp(x, lo, hi):
            """Limit x to the closed range [lo, hi]."""
            return max(lo, min(x, hi))
        '''
    tests = f"""
        import unittest

        from bounds import clamp


        class TestClamp(unittest.TestCase):
            def test_inside(self):
                self.assertEqual(clamp({inside}, {lo}, {hi}), {inside})

            def test_below(self):
                self.assertEqual(clamp({below}, {lo}, {hi}), {lo})

            def test_above(self):
                self.assertEqual(clamp({above}, {lo}, {hi}), {hi})
        """
    return _Module("bounds", good, good.replace("min(x, hi)", "min(x, lo)"), tests)


def _mean(r: random.Random) -> _Module:
    xs = [r.randint(1, 50) for _ in range(r.randint(3, 7))]
    good = '''
        def mean(xs):
            """The arithmetic mean of a non-empty list of numbers."""
            total = 0
            for x in xs:
                total += x
            return total / len(xs)
        '''
    tests = f"""
        import unittest

        from stats import mean


        class TestMean(unittest.TestCase):
            def test_mean(self):
                self.assertAlmostEqual(mean({xs}), {sum(xs) / len(xs)!r})

            def test_single(self):
                self.assertEqual(mean([{xs[0]}]), {xs[0]})
        """
    return _Module("stats", good, good.replace("for x in xs:", "for x in xs[1:]:"), tests)


def _leap(r: random.Random) -> _Module:
    century = r.choice([1700, 1800, 1900, 2100])
    good = '''
        def is_leap(year):
            """True for leap years of the Gregorian calendar."""
            return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        '''
    tests = f"""
        import unittest

        from calendar_rules import is_leap


        class TestLeap(unittest.TestCase):
            def test_common_years(self):
                self.assertFalse(is_leap({r.choice([2023, 2019, 1999])}))
                self.assertFalse(is_leap({century}))

            def test_leap_years(self):
                self.assertTrue(is_leap({r.choice([2024, 2016, 1996])}))
                self.assertTrue(is_leap({r.choice([1600, 2000, 2400])}))
        """
    bad = good.replace("(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0")
    return _Module("calendar_rules", good, bad, tests)


def _vowels(r: random.Random) -> _Module:
    words = ["Apple", "ORANGE", "Umbrella", "Idea", "Echo", "Ocean"]
    word = r.choice(words)
    good = '''
        def count_vowels(text):
            """How many of the letters a, e, i, o, u (any case) are in text."""
            return sum(1 for ch in text.lower() if ch in "aeiou")
        '''
    tests = f"""
        import unittest

        from text_tools import count_vowels


        class TestVowels(unittest.TestCase):
            def test_lower(self):
                self.assertEqual(count_vowels("banana"), 3)

            def test_mixed_case(self):
                self.assertEqual(count_vowels({word!r}), {sum(c in "aeiou" for c in word.lower())})
        """
    return _Module("text_tools", good, good.replace("text.lower()", "text"), tests)


def _fib(r: random.Random) -> _Module:
    n = r.randint(8, 25)
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    good = '''
        def fib(n):
            """The n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1."""
            a, b = 0, 1
            for _ in range(n):
                a, b = b, a + b
            return a
        '''
    tests = f"""
        import unittest

        from sequences import fib


        class TestFib(unittest.TestCase):
            def test_start(self):
                self.assertEqual([fib(i) for i in range(5)], [0, 1, 1, 2, 3])

            def test_large(self):
                self.assertEqual(fib({n}), {a})
        """
    return _Module("sequences", good, good.replace("range(n)", "range(n - 1)"), tests)


def _running(r: random.Random) -> _Module:
    xs = [r.randint(-9, 20) for _ in range(r.randint(4, 7))]
    sums, total = [], 0
    for x in xs:
        total += x
        sums.append(total)
    good = '''
        def running_total(xs):
            """The list of prefix sums of xs."""
            out, total = [], 0
            for x in xs:
                total += x
                out.append(total)
            return out
        '''
    tests = f"""
        import unittest

        from prefix import running_total


        class TestRunningTotal(unittest.TestCase):
            def test_values(self):
                self.assertEqual(running_total({xs}), {sums})

            def test_empty(self):
                self.assertEqual(running_total([]), [])
        """
    return _Module("prefix", good, good.replace("total += x", "total = x"), tests)


TEMPLATES: dict[str, Callable[[random.Random], _Module]] = {
    "clamp": _clamp,
    "mean": _mean,
    "leap": _leap,
    "vowels": _vowels,
    "fib": _fib,
    "running": _running,
}

_RUNNER = """
import os, sys, unittest
nonce = sys.stdin.readline().strip()
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(here))
suite = unittest.defaultTestLoader.discover(here, pattern="test_*.py", top_level_dir=here)
res = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
print("AGENTRL_VERIFY", nonce, res.testsRun, len(res.failures), len(res.errors),
      len(res.skipped), len(res.unexpectedSuccesses), flush=True)
"""


@dataclass(slots=True)
class Repo:
    """A generated repository: every file, the pristine tests, and the fix."""

    files: dict[str, str]
    tests: dict[str, str]
    buggy: str
    fix: dict[str, str]  # path -> correct source of the buggy module


def make_repo(rng: np.random.Generator) -> Repo:
    """Two or three modules with tests; one module has a planted bug."""
    r = random.Random(int(rng.integers(2**63 - 1)))
    kinds = r.sample(sorted(TEMPLATES), r.randint(2, 3))
    buggy = r.choice(kinds)
    files: dict[str, str] = {}
    tests: dict[str, str] = {}
    fix: dict[str, str] = {}
    for kind in kinds:
        mod = TEMPLATES[kind](r)
        path = f"{mod.name}.py"
        files[path] = textwrap.dedent(mod.bad if kind == buggy else mod.good).lstrip()
        if kind == buggy:
            fix[path] = textwrap.dedent(mod.good).lstrip()
        tests[f"tests/test_{mod.name}.py"] = textwrap.dedent(mod.tests).lstrip()
    files.update(tests)
    files["README.md"] = (
        "A small utility library.\n\nRun the tests with:\n\n    python3 -m unittest discover tests\n"
    )
    return Repo(files, tests, buggy, fix)


def _count_tests(tests: dict[str, str]) -> int:
    return sum(len(re.findall(r"^\s+def test_", src, re.MULTILINE)) for src in tests.values())


class BashFixTask(Task):
    """A repository with one failing test; scored against the pristine tests."""

    def __init__(self, repo: Repo):
        prompt = (
            "The Python repository in the working directory has a failing unit test. Find the "
            "bug in the library code and fix it; do not change the tests. Run the tests with "
            "`python3 -m unittest discover tests`. When all tests pass, reply 'done' without "
            "a tool call."
        )
        super().__init__(prompt, files=dict(repo.files), info={"buggy_template": repo.buggy})
        self.repo = repo
        self.pristine_tests = dict(repo.tests)
        self.expected_tests = _count_tests(repo.tests)
        self.last_check: dict[str, Any] = {}
        self.report = self._report  # a bound method, so copies of the task report their own

    def _report(self, answer: str) -> dict[str, Any]:
        return {k: v for k, v in self.last_check.items() if k != "passed"}

    async def score(self, answer: str, sandbox: Sandbox | None) -> float:
        assert sandbox is not None, "BashFix always has a sandbox"
        check = await verify_repo(sandbox, self.pristine_tests, self.expected_tests)
        self.last_check = check
        return 1.0 if check["passed"] else 0.0


async def verify_repo(
    sandbox: Sandbox, pristine: dict[str, str], expected: int, timeout: float = 60.0
) -> dict[str, Any]:
    """Run the pristine tests against the sandbox's code; see the module docstring."""
    modified = False
    for path, src in pristine.items():
        try:
            modified |= (await sandbox.read_file(path)).decode(errors="replace") != src
        except Exception:  # deleted or unreadable counts as modified
            modified = True
    vdir = f"_verify_{secrets.token_hex(6)}"
    for path, src in pristine.items():
        await sandbox.write_file(f"{vdir}/{path.split('/', 1)[1]}", src)
    await sandbox.write_file(f"{vdir}/runner.py", _RUNNER)
    nonce = secrets.token_hex(16)
    python = getattr(sandbox, "python", "python3")
    res = await sandbox.run(
        [python, "-I", f"{vdir}/runner.py"], stdin=nonce + "\n", timeout=timeout
    )
    await sandbox.run(["rm", "-rf", vdir], timeout=30)
    counts = None
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 7 and parts[0] == "AGENTRL_VERIFY" and parts[1] == nonce:
            counts = [int(p) for p in parts[2:]]
    passed = (
        counts is not None and counts[0] == expected and not any(counts[1:]) and not res.timed_out
    )
    report = {"tests_run": counts[0] if counts else 0, "expected_tests": expected}
    # Keep info deterministic: no timings, no random or host paths.
    log = re.sub(r"(Ran \d+ tests?) in [\d.]+s", r"\1", res.stderr[-2000:])
    log = re.sub(r'File "[^"]*/' + vdir + "/", 'File "tests/', log)
    workdir = getattr(sandbox, "workdir", None)
    if isinstance(workdir, str) and workdir:
        log = log.replace(workdir.rstrip("/") + "/", "")
    return {"passed": passed, "tests_modified": modified, **report, "log": log}


class BashFixEnv(ToolTaskEnv):
    """Fix a generated repository with ``bash`` and the file tools.

    ``sandbox`` is where the repository lives: a backend name (default
    ``"auto"``: the strongest backend this machine has, see ``make_sandbox``),
    a ``Sandbox``, a factory or a pool.
    """

    def __init__(self, sandbox: Any = "auto", **config: Any):
        config.setdefault("max_turns", 20)
        tools = ["bash", "read_file", "write_file", "edit_file"]
        super().__init__(self._task, tools, sandbox, **config)

    @staticmethod
    def _task(rng: np.random.Generator) -> BashFixTask:
        return BashFixTask(make_repo(rng))
