"""The sections of ``train`` (optimizer, evaluation, checkpointing, output): each key that sat
flat on ``train`` before still loads for one release, from YAML and from ``--set``, with a
``FutureWarning`` that names its new path, and lands where the new key would."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import yaml

from agentrl.errors import ConfigError
from agentrl.evaluation import EvaluationConfig
from agentrl.train.config import MOVED_KEYS, TrainConfig, TrainRunConfig, load_train_config

# A value for each old key that is not its default, so a key that is dropped cannot pass.
VALUES: dict[str, Any] = {
    "lr": 0.5, "weight_decay": 0.1, "betas": [0.8, 0.9], "warmup_steps": 3, "lr_schedule": "cosine",
    "max_grad_norm": 0.5, "eval_every": 3, "eval_episodes": 5, "eval_start": False,
    "eval_seed_start": 7, "eval_task_seeds": [1, 2], "eval_temperature": 0.3,
    "eval_env_kwargs": {"split": "b"}, "checkpoint_every": 4, "keep_checkpoints": 5,
    "export_hf": False, "out_dir": "runs/moved", "tensorboard": False, "plot": False, "save_trees": 2,
}


def _at(cfg: TrainRunConfig, path: str) -> Any:
    value: Any = cfg.train
    for part in path.split("."):
        value = getattr(value, part)
    return value


def test_every_moved_key_has_a_test_value():
    assert set(VALUES) == set(MOVED_KEYS)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_flat_key_loads_from_yaml_and_set_with_a_warning_naming_its_new_path(old, tmp_path):
    new = MOVED_KEYS[old]
    value = VALUES[old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new key alone warns about nothing
        want = load_train_config(None, [f"train.{new}={json.dumps(value)}"])
    assert _at(want, new) != _at(TrainRunConfig(), new)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {old: value}}))
    message = rf"train\.{old} is deprecated .*: use train\.{new.replace('.', '[.]')}$"
    with pytest.warns(FutureWarning, match=message):
        from_yaml = load_train_config(path)
    with pytest.warns(FutureWarning, match=message):
        from_set = load_train_config(None, [f"train.{old}={json.dumps(value)}"])
    for got in (from_yaml, from_set):
        assert _at(got, new) == _at(want, new)
        assert got.model_dump() == want.model_dump()


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_beside_its_new_path_is_an_error_naming_both(old):
    new, value = MOVED_KEYS[old], json.dumps(VALUES[old])
    with pytest.raises(ConfigError, match=rf"train\.{old} .*train\.{new.replace('.', '[.]')}"):
        load_train_config(None, [f"train.{old}={value}", f"train.{new}={value}"])


def test_a_bad_value_in_a_section_names_its_path_by_either_key():
    with pytest.raises(ConfigError, match=r"train\.evaluation\.every: Input should be greater"):
        load_train_config(None, ["train.evaluation.every=-1"])
    with pytest.warns(FutureWarning, match="use train.evaluation.every"), \
            pytest.raises(ConfigError, match=r"train\.evaluation\.every: Input should be greater"):
        load_train_config(None, ["train.eval_every=-1"])
    with pytest.raises(ConfigError, match=r"train\.output: must be a mapping"):
        load_train_config(None, ["train.output=runs/x", "train.out_dir=runs/y"])


def test_old_keys_from_python_join_a_section_given_as_a_model():
    with pytest.warns(FutureWarning, match="use train.evaluation.episodes"):
        t = TrainConfig(evaluation=EvaluationConfig(every=2), eval_episodes=3)
    assert (t.evaluation.every, t.evaluation.episodes, t.evaluation.seed_start) == (2, 3, 1_000_000)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_set_on_either_path_replaces_the_files_value_at_the_other(old, tmp_path):
    """A recipe that still has an old key, overridden on the new path (or the other way
    round): the override wins, with the warning, instead of a both-given error."""
    new, value = MOVED_KEYS[old], VALUES[old]
    default = _at(TrainRunConfig(), new)
    stale = tmp_path / "old.yaml"
    stale.write_text(yaml.safe_dump({"train": {old: value}}))
    updated = tmp_path / "new.yaml"
    updated.write_text(yaml.safe_dump({"train": TrainConfig.model_validate(
        {new.split(".")[0]: {new.split(".")[1]: value}}).model_dump(mode="json", include={new.split(".")[0]})}))
    with pytest.warns(FutureWarning, match=rf"train\.{old} is deprecated"):
        over_old = load_train_config(stale, [f"train.{new}={json.dumps(default)}"])
        over_new = load_train_config(updated, [f"train.{old}={json.dumps(default)}"])
    assert _at(over_old, new) == default != value
    assert _at(over_new, new) == default


def test_set_on_train_credit_reaches_the_options_of_an_old_credit_options(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"credit": "gigpo", "credit_options": {"gamma": 0.9, "omega": 0.5}}}))
    with pytest.warns(FutureWarning, match="train.credit_options is deprecated"):
        cfg = load_train_config(path, ["train.credit.gamma=0.5"])
    assert (cfg.train.credit.name, cfg.train.credit.gamma, cfg.train.credit.omega) == ("gigpo", 0.5, 0.5)
    with pytest.warns(FutureWarning, match="train.credit_options is deprecated"):
        other = load_train_config(path, ["train.credit=grpo"])  # as over {name: gigpo, gamma: 0.9}
    assert other.train.credit.name == "grpo"


def test_set_on_a_renamed_staleness_key_replaces_the_files_new_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"loss": {"max_token_staleness": 4}}}))
    with pytest.warns(FutureWarning, match=r"use train\.loss\.max_token_staleness"):
        cfg = load_train_config(path, ["train.loss.max_staleness=2"])
    assert cfg.train.loss.max_token_staleness == 2


def test_set_on_an_old_credit_option_sets_the_option_of_a_recipes_credit_mapping(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"credit": {"name": "gigpo", "gamma": 0.95, "omega": 0.5}}}))
    with pytest.warns(FutureWarning, match=r"train.credit_options is deprecated .*name: gigpo"):
        cfg = load_train_config(path, ["train.credit_options.gamma=0.5"])
    assert (cfg.train.credit.name, cfg.train.credit.gamma, cfg.train.credit.omega) == ("gigpo", 0.5, 0.5)
    with pytest.warns(FutureWarning, match=r"name: grpo"):  # no method named: grpo's option
        bare = load_train_config(None, ["train.credit_options.eps=0.001"])
    assert (bare.train.credit.name, bare.train.credit.eps) == ("grpo", 0.001)


def test_an_old_credit_option_then_a_method_by_set_keeps_the_option():
    with pytest.warns(FutureWarning, match="train.credit_options is deprecated"):
        cfg = load_train_config(None, ["train.credit_options.gamma=0.9", "train.credit=gigpo"])
    assert (cfg.train.credit.name, cfg.train.credit.gamma) == ("gigpo", 0.9)
