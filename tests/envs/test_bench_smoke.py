"""bench/env_throughput.py --quick runs end to end and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "env_throughput.py"


def test_env_throughput_quick_mode_writes_every_env(tmp_path):
    out = tmp_path / "throughput.json"
    envs = ["agentrl/GuessNumber-v0", "agentrl/WebShop-v0"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out), "--envs", *envs],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert set(result["envs"]) == set(envs)
    for row in result["envs"].values():
        assert row["steps"] == 300 and row["steps_per_s"] > 0
        assert row["reset_ms_p50"] > 0 and row["snapshot_us_p50"] > 0
    assert result["webshop_search"]["products"] >= 10_000
    assert result["webshop_search"]["queries_per_s"] > 0
    assert "GuessNumber" in proc.stdout  # the table was printed


def test_env_throughput_quick_mode_compares_real_textworld(tmp_path):
    if importlib.util.find_spec("textworld") is None:
        pytest.skip("textworld is not installed (pip install 'agentrl[textworld]')")
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--out",
            str(out),
            "--envs",
            "agentrl/TextWorld-v0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "AGENTRL_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["envs"]["agentrl/TextWorld-v0"]["steps_per_s"] > 0
    side = result["textworld_real_vs_ours"]
    assert side["ratio"] == side["ours_steps_per_s"] / side["real_steps_per_s"]
    assert (tmp_path / "cache" / "textworld").is_dir()  # games went to the given cache
