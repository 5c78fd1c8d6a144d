"""The run loader: trees indexed by offset and read on demand, summaries, metrics and config."""

from __future__ import annotations

import json
import time

import pytest

from agentrl.types import write_trees
from agentrl.viewer import Run, run_index
from agentrl.viewer.run import summarize_tree_dict, tree_files

from .conftest import fork_tree


def test_recorded_run_folder_lists_step_files_metrics_and_config(branched_run):
    run = Run(branched_run)
    assert [f.name for f in run.files] == ["step-000001.jsonl", "step-000002.jsonl"]
    assert len(run) == 4 and run.steps() == [1, 2]
    assert [s.step for s in run.summaries] == [1, 1, 2, 2]
    assert {s.seed for s in run.summaries} == {3, 5}
    assert run.config["train"]["credit"] == "tree"
    assert run.config["rollout"]["allocator"] == "segment_tree"
    assert any(r.get("phase") == "rl" for r in run.metrics)
    tree = run.tree(2)
    assert tree.meta["seed"] == run.summaries[2].seed and "token_values" in tree.meta


def test_summary_counts_failures_and_truncations_by_reason():
    s = summarize_tree_dict(fork_tree().to_dict())
    assert (s.episodes, s.successes, s.failed, s.truncated) == (3, 1, 1, 1)
    assert s.mean_reward == pytest.approx(0.5)  # the failed episode is left out
    assert s.success_rate == pytest.approx(0.5)
    assert s.reasons == {"failed: sandbox died": 1, "truncated: max_turns=2": 1}
    assert s.mean_turns == 2 and s.branch_points == 1 and s.family == "pick"


def test_a_single_trees_file_and_a_rollout_folder_both_open(tmp_path):
    f = tmp_path / "some.jsonl"
    write_trees(f, [fork_tree(1), fork_tree(2)])
    assert len(Run(f)) == 2 and Run(f).steps() == [None]
    (tmp_path / "r").mkdir()
    write_trees(tmp_path / "r" / "trajectories.jsonl", [fork_tree(3)])
    (tmp_path / "r" / "summary.json").write_text(json.dumps({"env": "agentrl/Fake-v0", "model": "tiny-random"}))
    run = Run(tmp_path / "r")
    assert len(run) == 1 and run.config["policy"]["model"] == "tiny-random"


def test_trees_folder_orders_steps_numerically(tmp_path):
    (tmp_path / "trees").mkdir()
    for k in (10, 2, 1):
        write_trees(tmp_path / "trees" / f"step-{k}.jsonl", [fork_tree(k)])
    assert [p.name for p in tree_files(tmp_path)] == ["step-1.jsonl", "step-2.jsonl", "step-10.jsonl"]
    assert Run(tmp_path).steps() == [1, 2, 10]


def test_a_torn_line_is_skipped_and_named(tmp_path):
    f = tmp_path / "trees.jsonl"
    write_trees(f, [fork_tree()])
    with open(f, "a") as fh:
        fh.write('{"meta": {"seed": 9}, "roots": [0], "nod')  # killed mid-write
    run = Run(f)
    assert len(run) == 1 and run.skipped == ["trees.jsonl:2"]


def test_missing_run_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="run folder or a trees JSONL"):
        Run(tmp_path / "nope")


def test_thousands_of_trees_index_fast_and_the_index_holds_no_tree(tmp_path):
    f = tmp_path / "trees.jsonl"
    write_trees(f, [fork_tree(i) for i in range(3000)])
    t0 = time.perf_counter()
    run = Run(f)
    index = json.dumps(run_index(run))
    took = time.perf_counter() - t0
    assert len(run) == 3000
    assert took < 10, f"indexing 3000 trees took {took:.1f} s"
    assert "a room with a box" not in index  # observations stay in the file until a tree is opened
    assert run.tree(2999).meta["seed"] == 2999


def test_the_viewer_counts_success_by_the_one_rule_of_node_success():
    from agentrl.types import Node, RolloutTree

    tree = RolloutTree(meta={"seed": 0})
    for reward in (0.5, 1.0):  # partial credit is no success; a full reward is
        tree.add(Node(action_ids=[1], reward=reward, terminated=True))
    tree.add(Node(action_ids=[1], reward=0.0, terminated=True, info={"success": True}))  # the env's word
    s = summarize_tree_dict(tree.to_dict())
    assert s.successes == sum(leaf.success for leaf in tree.leaves()) == 2
