"""From a hostile review of ``agentrl eval``: bad input fails before the model loads, and a
split with no tasks is never evaluated on other seeds."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from agentrl.config import Config
from agentrl.env import TextEnv, register_env
from agentrl.errors import ConfigError
from agentrl.eval_cli import register
from agentrl.evaluation import evaluate_split
from agentrl.policy.mock import MockPolicy

app = typer.Typer()


@app.callback()
def _main() -> None:
    """A host app for the eval command."""


register(app)
runner = CliRunner()


class EmptySplitEnv(TextEnv):
    """Splits "full" and "other" hold 2 tasks each, split "empty" none (a data folder with no games in it)."""

    max_steps = 1

    def __init__(self, split: str = "full"):
        super().__init__()
        self.split = split

    @property
    def num_tasks(self) -> int:
        return {"full": 2, "other": 2, "empty": 0}[self.split]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Say 1.", {"instruction": "say 1", "tools": []}

    def step(self, action: str):
        return "Done.", 1.0, True, False, {}


register_env("agentrl/TestEmptySplit-v0", entry_point=EmptySplitEnv)
MOCK = ["--backend", "mock", "--no-progress"]


@pytest.mark.parametrize(("flags", "said"), [
    (["--env", "TestEmptySplit", "--k", "3", "--samples", "2"], "--samples >= --k"),
    (["--env", "TestEmptySplit", "--k", "0"], "--k must be >= 1"),
    (["--env", "TestEmptySplit", "--k", "2", "--samples", "0"], "samples=0"),  # was taken as k
    (["--env", "agentrl/GuessNumber-v0", "--split", "test"], "takes no split"),
    (["--env", "TestEmptySplit", "--split", "full,empty"], "split 'empty' holds no tasks"),
    (["--env", "TestEmptySplit", "--split", "full,"], "--split 'full,': an empty split name"),
])
def test_bad_eval_input_is_an_error_before_the_model_loads(tmp_path, flags, said):
    """Each was found only inside the first split's evaluation, after the policy had loaded
    (minutes for a vLLM engine), or after the splits before it had run."""
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", *flags, *MOCK, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "".join(said.split()) in "".join(res.output.split()), res.output  # rich wraps lines
    assert "loading model" not in res.output
    assert not out.exists()


def test_a_split_with_no_tasks_is_an_error_not_rollout_episodes_other_seeds(tokenizer):
    """num_tasks 0 was read as 'the env does not say', and the split was evaluated on
    rollout.episodes seeds (8) that are not in it."""
    policy = MockPolicy(tokenizer, ["1"])
    with pytest.raises(ConfigError, match="agentrl/TestEmptySplit-v0: split 'empty' holds no tasks"):
        evaluate_split("agentrl/TestEmptySplit-v0", policy, Config(), split="empty")
    report, trees = evaluate_split("agentrl/TestEmptySplit-v0", policy, Config(), split="full")
    assert report.tasks == 2 and len(trees) == 2 and report.rows[-1].success == 1.0


def test_eval_plays_the_env_its_config_names_when_no_env_is_given(tmp_path):
    """One config for every command: ``rollout --config`` and ``train --config`` play env.id,
    while ``eval --config`` refused to run without ``--env`` naming it again."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("env: {id: agentrl/TestEmptySplit-v0}\npolicy: {backend: mock, mock_responses: ['1']}\n")
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--config", str(cfg), "--split", "full", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert '"env": "agentrl/TestEmptySplit-v0"' in (out / "summary.json").read_text()
    res = runner.invoke(app, ["eval", "--out", str(out), "--no-progress", "--backend", "mock"])
    assert res.exit_code == 2 and "give --env, or a --config whose env.id names it" in res.output, res.output


@pytest.mark.parametrize("flags", [["--k", "2", "--temperature", "0"],
                                   ["--k", "1", "--samples", "4", "--set", "sampling.temperature=0"]])
def test_several_samples_a_task_at_temperature_0_is_an_error(tmp_path, flags):
    """Greedy decoding plays one task's episode n times over: pass@k was pass@1 under another
    name, and the run took n times as long."""
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "TestEmptySplit", *flags, *MOCK, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "attemperature0(greedy)" in "".join(res.output.split()), res.output
    assert "loading model" not in res.output


def test_episodes_on_an_env_that_counts_its_split_is_an_error_that_names_limit(tmp_path):
    """--episodes 1 was ignored without a word where the env says how many tasks its split
    holds: the whole split ran (hours on a real benchmark)."""
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "TestEmptySplit", "--episodes", "1", *MOCK, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "--episodes1isnotreadhere" in "".join(res.output.split()) and "--limit" in res.output, res.output
    assert "loading model" not in res.output


def test_each_tree_of_a_several_split_eval_says_its_split(tmp_path):
    """Trees of --split a,b went into one trajectories.jsonl with the same env and seeds and
    nothing else to tell them apart: split a's task 0 and split b's task 0 read the same."""
    import json

    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "TestEmptySplit", "--split", "full,other", *MOCK, "--out", str(out)])
    assert res.exit_code == 0, res.output
    metas = [json.loads(line)["meta"] for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [(m["split"], m["seed"]) for m in metas] == [("full", 0), ("full", 1), ("other", 0), ("other", 1)]


def test_a_limit_above_the_tasks_an_uncounted_env_plays_is_an_error_naming_episodes(tmp_path):
    """On an env that does not say how many tasks its split holds, rollout.episodes (8) counts
    them: --limit 20 played 8 without a word."""
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "agentrl/GuessNumber-v0", "--limit", "20", *MOCK, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "--limit20isabovethe8tasks" in "".join(res.output.split()) and "--episodes" in res.output, res.output
    res = runner.invoke(app, ["eval", "--env", "agentrl/GuessNumber-v0", "--limit", "3", *MOCK, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert '"tasks": 3' in (out / "summary.json").read_text()


class BrokenEnv(TextEnv):
    def __init__(self, split: str = "a"):
        raise ValueError(f"no data for split {split!r}")


register_env("agentrl/TestBrokenEval-v0", entry_point=BrokenEnv)


def test_an_env_that_cannot_be_made_is_an_error_naming_it_not_a_traceback(tmp_path):
    """Only a TypeError about split was caught: any other error making the env went up as a
    traceback (exit 1)."""
    res = runner.invoke(app, ["eval", "--env", "TestBrokenEval", "--split", "x", *MOCK, "--out", str(tmp_path / "ev")])
    assert res.exit_code == 2, (res.output, res.exception)
    said = "".join(res.output.split())  # rich wraps lines
    assert "cannotmakeagentrl/TestBrokenEval-v0" in said and "ValueError:nodataforsplit'x'" in said
