"""``agentrl eval --config`` on a training config plays the training run's held-out tasks on an
env that does not count its split: it played ``rollout.seed`` on (0-7), the tasks of the SFT
warm start, and a number the training run never reported."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from agentrl.env import TextEnv, register_env
from agentrl.eval_cli import register

app = typer.Typer()


@app.callback()
def _main() -> None:
    """A host app for the eval command."""


register(app)

TRAIN = {"env": {"id": "agentrl/GuessNumber-v0", "kwargs": {"high": 8}}, "policy": {"backend": "mock"},
         "sft": {"seed_start": 0, "episodes": 4},
         "train": {"evaluation": {"seed_start": 500, "episodes": 3, "env_kwargs": {"high": 4}}}}


def _eval(tmp_path, config: dict, *flags: str) -> dict:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--config", str(path), "--out", str(out), "--no-progress", *flags])
    assert result.exit_code == 0, (result.output, result.exception)
    [report] = json.loads((out / "summary.json").read_text())["reports"]
    return {"seeds": [r["seed"] for r in report["results"]], "kwargs": report["settings"]["env_kwargs"],
            "output": " ".join(result.output.split())}


def test_a_training_config_is_evaluated_on_its_held_out_tasks(tmp_path):
    got = _eval(tmp_path, TRAIN)
    assert got["seeds"] == [500, 501, 502] and got["kwargs"] == {"high": "4"}
    assert "train.evaluation's held-out tasks" in got["output"]


def test_its_explicit_held_out_seeds_too(tmp_path):
    config = {**TRAIN, "train": {"evaluation": {"task_seeds": [9, 4]}}}
    assert _eval(tmp_path, config)["seeds"] == [9, 4]


@pytest.mark.parametrize(("config", "flags", "seeds"), [
    ({**TRAIN, "rollout": {"seed": 7}}, [], list(range(7, 15))),  # the user picked the tasks
    (TRAIN, ["--episodes", "2"], [0, 1]),
    (TRAIN, ["--set", "rollout.seed=3", "--set", "rollout.episodes=1"], [3]),
    ({k: v for k, v in TRAIN.items() if k not in ("train", "sft")}, [], list(range(8))),  # a run config
    ({**TRAIN, "train": {"evaluation": {"episodes": 0}}}, [], list(range(8))),  # no held-out tasks
])
def test_tasks_the_user_names_or_a_config_without_held_out_tasks_play_rollout_seed_on(
        tmp_path, config, flags, seeds):
    got = _eval(tmp_path, config, *flags)
    assert got["seeds"] == seeds and got["kwargs"] == {"high": "8"}


class LongEnv(TextEnv):
    """Does not count its tasks; says its episodes may take 50 steps."""

    max_steps = 50

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Say 1.", {"instruction": "say 1", "tools": []}

    def step(self, action: str):
        return "Done.", 1.0, True, False, {}


register_env("agentrl/TestEvalLong-v0", entry_point=LongEnv)


@pytest.mark.parametrize(("rollout", "max_turns"), [
    ({}, 16),  # the held-out tasks, with the turns the training run gave them (rollout.max_turns)
    ({"seed": 3}, 50),  # tasks of the user's: the env's own limit, as on any split
    ({"seed": 3, "max_turns": 5}, 5),
])
def test_held_out_tasks_take_the_turns_the_training_run_gave_them(tmp_path, rollout, max_turns):
    config = {"env": {"id": "agentrl/TestEvalLong-v0"}, "policy": {"backend": "mock"}, "rollout": rollout,
              "train": {"evaluation": {"episodes": 2}}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--config", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, (result.output, result.exception)
    [report] = json.loads((out / "summary.json").read_text())["reports"]
    assert report["settings"]["max_turns"] == max_turns


def test_a_bad_held_out_section_is_the_error_agentrl_train_gives(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**TRAIN, "train": {"evaluation": {"episods": 3}}}))
    result = CliRunner().invoke(app, ["eval", "--config", str(path), "--out", str(tmp_path / "e"), "--no-progress"])
    assert result.exit_code == 2
    assert ("train.evaluation.episods: unknown key (did you mean 'train.evaluation.episodes'?)"
            in " ".join(result.output.split()))


@pytest.mark.parametrize(("evaluation", "flags", "temperature"), [
    ({"temperature": 0.5}, [], 0.5),  # as the training run evaluated
    ({"temperature": None}, [], 0.9),  # null: sampling.temperature, in training too
    ({}, [], 0.0),  # greedy, in both
    ({"temperature": 0.5}, ["--temperature", "0"], 0.0),  # the flag wins
    ({"temperature": 0.5}, ["--episodes", "2"], 0.0),  # tasks of the user's: agentrl eval's greedy default
])
def test_held_out_tasks_are_played_at_the_training_runs_evaluation_temperature(
        tmp_path, evaluation, flags, temperature):
    config = {**TRAIN, "sampling": {"temperature": 0.9}, "train": {"evaluation": {"episodes": 2, **evaluation}}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--config", str(path), "--out", str(out), "--no-progress", *flags])
    assert result.exit_code == 0, (result.output, result.exception)
    [report] = json.loads((out / "summary.json").read_text())["reports"]
    assert report["temperature"] == temperature


@pytest.mark.parametrize(("flags", "named"), [
    ([], True),  # policy.model is where training starts: the run's model is one flag away
    (["--model", "tiny-random"], False),  # the user chose
])
def test_a_training_config_whose_run_has_checkpoints_names_the_trained_model(tmp_path, flags, named):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    config = {**TRAIN, "train": {**TRAIN["train"], "output": {"dir": str(run)}}}
    got = _eval(tmp_path, config, *flags)
    hint = f"policy.model=smollm2-135m is the model the training run started from: give --model {run}"
    assert (hint in got["output"]) == named, got["output"]
