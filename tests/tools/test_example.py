"""The 20-line tool-environment example runs and wins its episode."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_env.py"


def test_example_is_at_most_20_lines():
    assert len(EXAMPLE.read_text().splitlines()) <= 20


def test_example_runs_as_a_script_and_scores_one():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.rstrip().endswith("reward 1.0, done True"), out.stdout + out.stderr
    assert "<tool_response>" in out.stdout


def test_example_task_factory_gives_a_verifiable_task():
    import numpy as np

    make_task = runpy.run_path(str(EXAMPLE))["make_task"]
    task = make_task(np.random.default_rng(1))
    a, b = (int(w.rstrip("?")) for w in task.prompt.split()[2:5:2])
    assert task.verify(str(a * b)) and not task.verify(str(a * b + 1))
