"""Writing a run's files: whole files, even when two runs write one folder at once."""

from __future__ import annotations

import json

from agentrl.config import load_config
from agentrl.policy import MockPolicy
from agentrl.rollout import collect, summarize, write_run
from agentrl.types import read_trees


def test_two_runs_writing_one_folder_at_once_each_leave_whole_files(tokenizer, tmp_path):
    """Two ``agentrl rollout`` commands with the default ``rollout.out_dir`` share the folder:
    each write lands whole (the last one wins), none fails for the other's temporary file."""
    trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), load_config(), [0, 1])

    def meanwhile():  # the other run writes while this one is half way through its trees
        yield trees[0]
        write_run(tmp_path, trees[1:], {**summarize(trees[1:], 1.0), "run": "other"})
        yield trees[1]

    write_run(tmp_path, meanwhile(), {**summarize(trees, 1.0), "run": "this"})  # type: ignore[arg-type]
    assert [t.meta["seed"] for t in read_trees(tmp_path / "trajectories.jsonl")] == [0, 1]
    assert json.loads((tmp_path / "summary.json").read_text())["run"] == "this"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "trajectories.jsonl"]


def test_numpy_task_seeds_are_written_as_ints(tokenizer, tmp_path):
    """Seeds from numpy (``np.arange``, a Generator's ``integers``) played, then writing the
    run failed: the tree's meta held an int64, which JSON does not take."""
    import numpy as np
    import pytest

    seeds = list(np.arange(2))
    trees = collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), load_config(), seeds)
    write_run(tmp_path, trees, summarize(trees, 1.0))
    assert [t.meta["seed"] for t in read_trees(tmp_path / "trajectories.jsonl")] == [0, 1]
    for bad in (1.5, "3", True):
        with pytest.raises(ValueError, match=f"task seed {bad!r} is not an integer"):
            collect("agentrl/GuessNumber-v0", MockPolicy(tokenizer, ["1"]), load_config(), [0, bad])
