"""``agentrl report``: report.md and its plots, for one run and for two side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentrl.types import write_trees
from agentrl.viewer.cli import register
from agentrl.viewer.report import gather, write_report

from .conftest import fork_tree

RUN = Path(__file__).parent / "data" / "branched_run"


def test_budget_shares_are_counted_from_roots_and_first_grown_paths(tmp_path):
    write_trees(tmp_path / "trees.jsonl", [fork_tree()])  # one root, three leaves
    b = gather(tmp_path / "trees.jsonl").budget[None]
    assert (b["fresh_leaves"], b["branch_leaves"]) == (1, 2)
    assert (b["fresh_turns"], b["branch_turns"]) == (2, 2)  # nodes 0, 1 | nodes 2, 3
    assert (b["fresh_tokens"], b["branch_tokens"]) == (3, 2)


def test_report_of_the_recorded_run_has_every_section_and_plot(tmp_path):
    md = write_report([RUN], tmp_path / "rep")
    text = md.read_text()
    for heading in ("## Learning curves", "## Success per task family", "## Tokens and turns per episode",
                    "## Branch budget", "## Teacher-student divergence per turn"):
        assert heading in text
    for png in ("learning_curves.png", "family_success.png", "episode_lengths.png", "branch_budget.png",
                "distill_per_turn.png"):
        assert f"]({png})" in text and (tmp_path / "rep" / png).stat().st_size > 5_000
    assert "| branched_run | segment_tree | 0.500 |" in text  # 2 roots of 4 leaves in every tree
    assert "from the saved per-token values" in text
    assert "| rollout success (first → last step) | 0.125 → 0.625 |" in text


def test_two_runs_side_by_side_and_a_run_without_metrics(tmp_path):
    (tmp_path / "flat").mkdir()
    write_trees(tmp_path / "flat" / "trajectories.jsonl",
                [fork_tree(1, allocator="independent"), fork_tree(2, allocator="independent")])
    (tmp_path / "flat" / "summary.json").write_text(json.dumps({"env": "agentrl/Fake-v0", "model": "m"}))
    runner = CliRunner()
    app = typer.Typer()
    register(app)
    res = runner.invoke(app, ["report", str(RUN), str(tmp_path / "flat"), "--out", str(tmp_path / "ab")])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "ab" / "report.md").read_text()
    assert text.startswith("# Run report: branched_run vs flat")
    assert "| credit | tree | – |" in text
    assert "| pick: " not in text and "| pick | – | 0.500 (4) |" in text  # the family of the hand-made trees
    alone = write_report([tmp_path / "flat"]).read_text()
    assert "No `metrics.jsonl` rows" in alone and "No tree allocator ran" in alone
    assert "Distillation did not run" in alone


def test_report_refuses_three_runs():
    with pytest.raises(ValueError, match="one run or two"):
        write_report([RUN, RUN, RUN])


def test_report_of_a_folder_that_is_no_run_says_so_and_writes_nothing(tmp_path):
    """A mistyped folder gave a report of dashes."""
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(FileNotFoundError, match="holds no trees and no metrics.jsonl: not a run folder"):
        write_report([tmp_path])
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        write_report([RUN, tmp_path])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_divergence_per_turn_skips_masked_tokens_and_episodes_left_out(tmp_path):
    t = fork_tree()
    t.meta["token_values"] = {"1": {"advantages": [0.5, None, 2.0], "teacher_logprobs": [-0.1, None, -0.4],
                                    "student_logprobs": [-0.2, None, -1.0]},
                              "2": {"trained": False, "reason": "MC-GRPO's pivot"}}
    plain = fork_tree(2)
    plain.meta["token_values"] = {"1": {"advantages": [0.5, 0.5, 2.0]}}  # no teacher: no divergence
    write_trees(tmp_path / "trees.jsonl", [t])
    write_trees(tmp_path / "plain.jsonl", [plain])
    # log pi_s - log pi_t per turn: turn 1 only its first token (-0.2 + 0.1), turn 2 (-1.0 + 0.4)
    div = gather(tmp_path / "trees.jsonl").divergence[None]
    assert dict(div) == {0: [pytest.approx(-0.1)], 1: [pytest.approx(-0.6)]}
    assert not gather(tmp_path / "plain.jsonl").distilled
