"""Configs: YAML plus CLI overrides, and errors that name the key path."""

from __future__ import annotations

import pytest

from agentrl.config import Config, load_config
from agentrl.errors import ConfigError


def test_defaults_validate():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.policy.model == "smollm2-135m"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  backend: mock\nsampling:\n  temperature: 0.5\n")
    cfg = load_config(path, ["sampling.temperature=0", "rollout.episodes=3", "sampling.stop=[x, y]"])
    assert cfg.policy.backend == "mock"
    assert cfg.sampling.temperature == 0.0
    assert cfg.rollout.episodes == 3
    assert cfg.sampling.stop == ["x", "y"]


def test_unknown_key_names_its_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("policy:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"policy\.temprature: unknown key"):
        load_config(path)


def test_bad_value_names_path_and_reason():
    with pytest.raises(ConfigError, match=r"sampling\.top_p: Input should be less than or equal to 1"):
        load_config(overrides=["sampling.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"policy\.backend: Input should be 'auto', 'hf', 'vllm', 'openai' or 'mock'"):
        load_config(overrides=["policy.backend=tpu"])
    with pytest.raises(ConfigError, match=r"rollout\.episodes: Input should be a valid integer"):
        load_config(overrides=["rollout.episodes=many"])


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["sampling.top_k=-1", "env.nope=1"])
    assert "sampling.top_k" in str(e.value) and "env.nope: unknown key" in str(e.value)


def test_malformed_override_and_file(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(overrides=["rollout.episodes"])
    with pytest.raises(ConfigError, match="rollout.seed: is a value"):
        load_config(overrides=["rollout.seed=1", "rollout.seed.x=2"])
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_auto_backend_picks_vllm_only_where_it_is_installed(monkeypatch):
    import importlib.util

    from agentrl.policy.registry import resolve_backend

    assert load_config().policy.backend == "auto"
    assert resolve_backend("mock") == ("mock", "configured")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_backend("auto")[0] == "hf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    picked, why = resolve_backend("auto")
    assert picked == "vllm" and "faster" in why


def test_unknown_key_suggests_the_nearest_keys():
    from agentrl.train.config import load_train_config

    with pytest.raises(ConfigError, match=r"train\.lora_rank: unknown key \(did you mean 'train\.lora\.r'"):
        load_train_config(None, ["train.lora_rank=8"])
    with pytest.raises(ConfigError, match=r"trainn: unknown key \(did you mean 'train'"):
        load_train_config(None, ["trainn.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"rollout\.max_turn: unknown key \(did you mean 'rollout\.max_turns'"):
        load_config(None, ["rollout.max_turn=3"])


def test_bad_allocator_options_fail_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"rollout\.allocator_options: allocator key_state: option 'k' must be >= 1"):
        load_config(None, ["rollout.allocator=key_state", "rollout.allocator_options.k=0"])
    with pytest.raises(ConfigError, match="unknown option 'kk'"):
        load_config(None, ["rollout.allocator=key_state", "rollout.allocator_options.kk=2"])
    with pytest.raises(ConfigError, match="did you mean 'segment_tree'"):
        load_config(None, ["rollout.allocator=segment_trees"])
    cfg = load_config(None, ["rollout.allocator=segment_tree", "rollout.allocator_options.depth=2"])
    cfg.rollout.allocator, cfg.rollout.allocator_options = "independent", {}  # evaluation's switch still works
