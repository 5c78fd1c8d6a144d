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


def _load_bench():
    spec = importlib.util.spec_from_file_location("env_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_env_throughput_quick_mode_writes_every_env(tmp_path):
    out = tmp_path / "throughput.json"
    envs = ["agentrl/GuessNumber-v0", "agentrl/WebShop-v0"]
    tool_envs = ["agentrl/MathPython-v0", "agentrl/SearchQA-v0"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out), "--envs", *envs, *tool_envs],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert set(result["envs"]) == {*envs, *tool_envs}
    for env_id, row in result["envs"].items():
        assert row["steps"] == (20 if env_id in tool_envs else 300) and row["steps_per_s"] > 0
        assert row["reset_ms_p50"] > 0 and row["snapshot_us_p50"] > 0
        assert row["failed_steps"] == 0
    # Tool rows made real calls: the interpreter, the calculator and the search index ran.
    math_row, search_row = (result["envs"][e] for e in tool_envs)
    assert math_row["tool_calls"] > 0 and set(math_row["tool_ms_p50"]) == {"python", "calculator"}
    assert search_row["tool_calls"] > 0 and set(search_row["tool_ms_p50"]) == {"search"}
    latency = result["tool_call_latency"]["agentrl/MathPython-v0"]
    assert latency["local"]["tool_calls"] > 0 and latency["local"]["tool_ms_p50"]["python"] > 0
    assert result["webshop_search"]["products"] >= 10_000
    assert result["webshop_search"]["queries_per_s"] > 0
    assert "GuessNumber" in proc.stdout and "tool-call latency" in proc.stdout


def test_alfworld_comparison_passes_its_step_count(monkeypatch):
    real_engine = pytest.importorskip("agentrl.envs.alfworld.real_engine")
    seen = {}

    def fake_timer(*, n_steps: int, seed: int = 0) -> dict:
        seen["n_steps"] = n_steps
        return {"steps": float(n_steps), "steps_per_s": 10.0}

    monkeypatch.setattr(real_engine, "time_real_engine", fake_timer)
    out = _load_bench().alfworld_side_by_side(n_steps=7, ours={"steps_per_s": 20.0})
    assert seen == {"n_steps": 7} and out["ratio"] == 2.0


def test_bench_step_counts_are_keyword_only():
    bench = _load_bench()
    for fn in (bench.measure_env, bench.tool_call_latency, bench.alfworld_side_by_side):
        with pytest.raises(TypeError):
            fn("agentrl/GuessNumber-v0", 5)


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
