"""bench/sandbox_latency.py runs end to end on a tiny budget and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.anyio
BENCH = Path(__file__).resolve().parents[2] / "bench" / "sandbox_latency.py"


async def test_bench_smoke_writes_table_json(tmp_path):
    spec = importlib.util.spec_from_file_location("sandbox_latency", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "lat.json"
    report = await module.main(["--reps", "2", "--cold-reps", "1", "--backends", "local",
                                "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["results"]["local"]["warm/cmd"]["n"] == 2
    assert saved["results"]["local"]["par8/cmd"]["execs_per_s"] > 0
    assert report["targets"][0]["path"] == "interp/py"
