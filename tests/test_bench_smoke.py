"""The core benches run end to end in --quick mode and check what their rows claim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(script: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def test_rollout_overhead_checks_that_every_path_samples_the_same_tokens(tmp_path):
    result = _run("rollout_overhead.py", tmp_path / "r.json")
    assert result["rows"] > 0 and result["action_tokens"] > 0
    assert result["rows_differing_policy"] == 0
    assert 0 <= result["rows_differing_hf_generate"] <= result["rows"]


def test_multiturn_cost_reuse_prefills_less_and_samples_the_same(tmp_path):
    result = _run("multiturn_cost.py", tmp_path / "m.json")
    reuse, full = result["rows"]
    assert (reuse["config"], full["config"]) == ("hf+reuse", "hf")
    assert full["prefilled_tokens"] == full["sum_of_contexts"] and full["reused_tokens"] == 0
    assert reuse["sum_of_deltas"] <= reuse["prefilled_tokens"] < full["prefilled_tokens"]
    assert reuse["prefilled_tokens"] + reuse["reused_tokens"] == reuse["sum_of_contexts"]
    assert reuse["cache"]["hits"] > 0
    assert result["first_turn_where_samples_differ"] is None
