"""Edges of the config, ``agentrl rollout`` and ``agentrl eval``: which split a training config
evaluates, environment variables kept as text, a bound on ``rollout.episodes``, an output
folder's earlier results, each split's report written as it ends, a teacher's path expanded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from agentrl import eval_cli
from agentrl.config import load_config
from agentrl.env import TextEnv, register_env
from agentrl.errors import ConfigError
from agentrl.rollout.summary import make_out_dir
from agentrl.train.config import load_train_config

runner = CliRunner()


def _app() -> typer.Typer:
    """``agentrl rollout`` and ``agentrl eval`` in one host app."""
    from agentrl.cli import app as main_app

    host = typer.Typer()
    host.registered_commands += main_app.registered_commands
    eval_cli.register(host)
    return host


def _text(result: Any) -> str:
    return "".join(result.output.split())  # rich wraps long lines, paths too


class CountedSplitEnv(TextEnv):
    """Counts its tasks, as the real ALFWorld and WebShop envs do: split "train" holds 5,
    "valid_seen" 2. Every episode wins in one step."""

    max_steps = 3

    def __init__(self, split: str = "train"):
        super().__init__()
        self.split = split

    @property
    def num_tasks(self) -> int:
        return {"train": 5, "valid_seen": 2}[self.split]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return "Say 1.", {"instruction": "say 1", "tools": []}

    def step(self, action: str):
        return "Done.", 1.0, True, False, {}


register_env("agentrl/TestCountedSplit-v0", entry_point=CountedSplitEnv)

TRAIN = {"env": {"id": "agentrl/TestCountedSplit-v0"}, "policy": {"backend": "mock"},
         "train": {"evaluation": {"episodes": 3, "env_kwargs": {"split": "valid_seen"}}}}


def _eval(tmp_path, config: dict, *flags: str) -> tuple[Any, Any]:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "eval"
    result = runner.invoke(_app(), ["eval", "--config", str(path), "--out", str(out), "--no-progress", *flags])
    return result, out


# -- 1. agentrl eval on a training config: the split its held-out evaluation plays -------------------

def test_eval_of_a_training_config_plays_the_split_of_its_held_out_evaluation(tmp_path):
    result, out = _eval(tmp_path, TRAIN)
    assert result.exit_code == 0, (result.output, result.exception)
    [report] = json.loads((out / "summary.json").read_text())["reports"]
    # valid_seen holds 2 tasks (train 5): the whole split the training run evaluated on
    assert report["settings"]["env_kwargs"] == {"split": "valid_seen"} and report["split"] == "valid_seen"
    assert [r["seed"] for r in report["results"]] == [0, 1]
    assert {json.loads(line)["meta"]["split"] for line in (out / "trajectories.jsonl").read_text().splitlines()} == {
        "valid_seen"}
    assert "train.evaluation.env_kwargs" in _text(result)


def test_eval_split_flag_still_picks_the_split(tmp_path):
    result, out = _eval(tmp_path, TRAIN, "--split", "train")
    assert result.exit_code == 0, (result.output, result.exception)
    [report] = json.loads((out / "summary.json").read_text())["reports"]
    assert report["settings"]["env_kwargs"] == {"split": "train"} and report["tasks"] == 5


# -- 2. train.harness_env: environment variables are text --------------------------------------------

@pytest.mark.parametrize(("yaml_value", "read_as"), [
    ("0123", "the int 83"), ("yes", "the bool True"), ("on", "the bool True"), ("1.50", "the float 1.5"), ("1.0e+3", "the float 1000.0")])
def test_a_harness_env_value_yaml_read_as_no_text_is_refused_naming_the_key(tmp_path, yaml_value, read_as):
    path = tmp_path / "train.yaml"
    path.write_text(f"train:\n  harness_env:\n    FOO: {yaml_value}\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    assert "train.harness_env.FOO" in str(err.value) and f"YAML read the value as {read_as}" in str(err.value)
    assert "quote it" in str(err.value)


def test_a_harness_env_value_quoted_or_given_with_set_is_kept_as_written(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("train:\n  harness_env:\n    FOO: '0123'\n    BAR: 'yes'\n")
    cfg = load_train_config(path, ["train.harness_env.N=0123", "train.harness_env.ON=on",
                                   "train.harness_env.E=1e3", "train.harness_env.T=2"])
    assert cfg.train.harness_env == {"FOO": "0123", "BAR": "yes", "N": "0123", "ON": "on", "E": "1e3", "T": "2"}


# -- 3. rollout.episodes is bounded ----------------------------------------------------------------------

def test_rollout_episodes_past_the_bound_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.episodes: .*1000000000000.*at most 1,000,000"):
        load_config(None, ["rollout.episodes=1000000000000"])
    assert load_config(None, ["rollout.episodes=1000000"]).rollout.episodes == 1_000_000


# -- 4. an output folder's earlier results are not replaced silently -----------------------------------

MOCK = ["--backend", "mock", "--no-progress"]


@pytest.mark.parametrize(("command", "key"), [
    (["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "1"], "rollout.out_dir"),
    (["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "1"], "--out")])
def test_a_folder_with_results_is_refused_unless_overwrite(tmp_path, command, key):
    out = tmp_path / "run"
    first = runner.invoke(_app(), [*command, *MOCK, "--out", str(out)])
    assert first.exit_code == 0, first.output
    before = (out / "summary.json").read_text()
    again = runner.invoke(_app(), [*command, *MOCK, "--out", str(out)])
    assert again.exit_code == 2
    assert f"{key}={out}alreadyholdsresults" in _text(again) and "--overwrite" in _text(again)
    assert (out / "summary.json").read_text() == before
    forced = runner.invoke(_app(), [*command, *MOCK, "--out", str(out), "--overwrite"])
    assert forced.exit_code == 0, forced.output


def test_make_out_dir_says_a_file_is_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        make_out_dir(tmp_path / "f", "rollout.out_dir")
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="is a link to nothing, not a folder"):
        make_out_dir(tmp_path / "gone", "rollout.out_dir")
    assert make_out_dir(tmp_path / "new", "rollout.out_dir").is_dir()
    assert make_out_dir(tmp_path / "new", "rollout.out_dir").is_dir()  # an existing folder is fine


def test_make_out_dir_does_not_look_before_it_makes(tmp_path, monkeypatch):
    """A folder made by another process between a look and the mkdir was called a file."""
    from pathlib import Path

    looked = []
    monkeypatch.setattr(Path, "exists", lambda self, **_: looked.append(self) or False)
    assert make_out_dir(tmp_path / "new", "rollout.out_dir").is_dir()
    assert looked == []


# -- 5. eval --split a,b: each split's report is written when it ends --------------------------------

def test_a_ctrl_c_between_splits_keeps_the_finished_splits_report(tmp_path, monkeypatch):
    real = eval_cli.evaluate_split

    def stop_at_b(env_id, policy, cfg, **kw):
        if kw["plan"].split == "valid_seen":  # Ctrl-C as the second split starts
            raise KeyboardInterrupt
        return real(env_id, policy, cfg, **kw)

    monkeypatch.setattr(eval_cli, "evaluate_split", stop_at_b)
    out = tmp_path / "ev"
    result = runner.invoke(_app(), ["eval", "--env", "agentrl/TestCountedSplit-v0", "--split", "train,valid_seen",
                                    *MOCK, "--out", str(out)])
    assert result.exit_code == 130, (result.output, result.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and [r["split"] for r in summary["reports"]] == ["train"]
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 5


# -- 6. train.distill.teacher as a path expands ~ and $NAME ---------------------------------------------

def test_a_teacher_path_expands_home_and_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TEACHERS", "/models")
    cfg = load_train_config(None, ["train.distill.teacher=~/teacher/hf"])
    assert cfg.train.distill.teacher == f"{tmp_path}/teacher/hf"
    cfg = load_train_config(None, ["train.distill.teacher=vllm:$TEACHERS/big"])
    assert cfg.train.distill.teacher == "vllm:/models/big"
    assert load_train_config(None, ["train.distill.teacher=smollm2-135m"]).train.distill.teacher == "smollm2-135m"
    with pytest.raises(ConfigError, match=r"train\.distill\.teacher: \$NOPE is not set"):
        load_train_config(None, ["train.distill.teacher=$NOPE/x"])


# -- a flag's text arrives as written ----------------------------------------------------------------

@pytest.mark.parametrize("command", [["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "1"],
                                     ["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "1"]])
def test_an_out_flag_that_yaml_reads_as_a_number_is_still_the_folder(tmp_path, monkeypatch, command):
    """``--out 2024`` was read as YAML, the int 2024, and refused: "quote it to keep it text"."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(_app(), [*command, *MOCK, "--out", "2024"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "2024" / "summary.json").exists()


def test_flag_overrides_quote_text_and_keep_numbers():
    from agentrl.config import flag_overrides

    assert flag_overrides({"policy.model": "0123", "rollout.episodes": 3, "x": None, "a.b": 'say "hi"'}) == [
        'policy.model="0123"', "rollout.episodes=3", 'a.b="say \\"hi\\""']
    for text in ("0123", "on", "runs/\U0001f600", "a\\b: c # d", "\x7f", ""):  # each as written
        cfg = load_config(None, flag_overrides({"rollout.system_prompt": "x" + text, "rollout.out_dir": text or "."}))
        assert (cfg.rollout.system_prompt, cfg.rollout.out_dir) == ("x" + text, text or ".")


@pytest.mark.parametrize("key", ["train.evaluation.episodes", "sft.episodes", "train.tasks_per_step"])
def test_other_task_counts_are_bounded_too(key):
    """Each planned a list of that many seeds (train.evaluation.episodes: agentrl eval too)."""
    with pytest.raises(ConfigError, match=rf"{key}: Input should be less than or equal to 1000000"):
        load_train_config(None, [f"{key}=1000000000000"])


def test_a_split_given_twice_is_refused():
    with pytest.raises(ConfigError, match="split 'a' is given twice"):
        eval_cli.split_names("a,b, a")
    assert eval_cli.split_names("a,b") == ["a", "b"]


@pytest.mark.parametrize("key", ["rollout.out_dir", "policy.model", "train.output.dir"])
def test_a_path_that_expands_to_nothing_is_refused(monkeypatch, key):
    """``$RUN`` with RUN set to '' was '', the working directory, where train --overwrite removes
    the checkpoints, tensorboard and trees folders."""
    monkeypatch.setenv("RUN", "")
    with pytest.raises(ConfigError, match=rf"{key}: '\$RUN' expands to an empty path"):
        load_train_config(None, [f"{key}=$RUN"])


@pytest.mark.parametrize(("env", "said"), [({"A=B": "1"}, "'A=B' is no environment variable name"),
                                           ({"": "1"}, "'' is no environment variable name"),
                                           ({"A": "x\0y"}, "A: a value cannot hold a NUL")])
def test_a_harness_env_the_os_refuses_fails_when_the_config_loads(env, said):
    from agentrl.train.config import TrainRunConfig

    with pytest.raises(ValueError, match=f"train.harness_env\n.*{said}"):
        TrainRunConfig.model_validate({"train": {"harness_env": env}})


def test_the_rollout_bar_counts_to_the_episodes_independent_n_plays(tmp_path, monkeypatch):
    """3 tasks, group_size 4, independent n=2: 6 episodes play; the bar was made for 12 (it was
    corrected only once the run ended)."""
    from rich.progress import Progress

    totals = []
    add_task = Progress.add_task
    monkeypatch.setattr(Progress, "add_task", lambda self, *a, **k: totals.append(k.get("total")) or add_task(
        self, *a, **k))
    result = runner.invoke(_app(), ["rollout", "--env", "agentrl/GuessNumber-v0", "--episodes", "3", *MOCK,
                                    "--set", "rollout.group_size=4", "--allocator", "independent", "--allocator-option", "n=2",
                                    "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert totals == [6]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["episodes"] == 6


def test_a_distill_config_built_directly_expands_its_teacher_path(monkeypatch):
    """The expansion lived in the train config's validator, so DistillConfig(teacher="~/x") built
    by hand (the Python API) looked for a folder named '~'."""
    from agentrl.train.distill.config import DistillConfig

    monkeypatch.setenv("MODELS", "/models")
    assert DistillConfig(teacher="vllm:$MODELS/big").teacher == "vllm:/models/big"
    assert DistillConfig(teacher="~/t").teacher.startswith(str(Path.home()))
    assert DistillConfig(teacher="smollm2-135m").teacher == "smollm2-135m"
