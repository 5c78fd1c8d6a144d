"""Configs: YAML plus CLI overrides, and errors that name the key path."""

from __future__ import annotations

import pytest

from agentrl.allocator_options import IndependentOptions, SegmentTreeOptions
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


BAD_OPTIONS = {"independent": ("n", 0), "pilot_commit": ("pilots", 0), "entropy_branch": ("penalty", 2.0),
               "segment_tree": ("width", 0), "key_state": ("top1_threshold", 0.0), "contrastive": ("path_decay", 0.0)}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_each_allocators_options_reject_a_bad_option_naming_the_key_path(name):
    key, bad = BAD_OPTIONS[name]
    with pytest.raises(ConfigError, match=rf"rollout\.allocator\.{key}: (Input should be|must be an int >= 1)"):
        load_config(None, [f"rollout.allocator={{name: {name}, {key}: {bad}}}"])
    with pytest.raises(ConfigError, match=rf"rollout\.allocator\.{key}s: unknown key \(did you mean 'rollout\.allocator\.{key}'"):
        load_config(None, [f"rollout.allocator={{name: {name}, {key}s: 1}}"])
    with pytest.raises(ConfigError, match=r"rollout\.allocator\.est_leaf_cost: Input should be greater than 0"):
        load_config(None, [f"rollout.allocator.name={name}", "rollout.allocator.est_leaf_cost=0"])


def test_bad_allocator_name_fails_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"rollout\.allocator: unknown allocator 'segment_trees' \(did you mean 'segment_tree'"):
        load_config(None, ["rollout.allocator=segment_trees"])
    with pytest.raises(ConfigError, match=r"rollout\.allocator: name the allocator"):
        load_config(None, ["rollout.allocator.depth=2"])
    with pytest.raises(ConfigError, match=r"rollout\.allocator\.in_turn: Input should be a valid boolean"):
        load_config(None, ["rollout.allocator.name=key_state", "rollout.allocator.in_turn=sometimes"])


def test_allocator_by_name_alone_takes_default_options_and_keys_set_below_it():
    cfg = load_config(None, ["rollout.allocator=segment_tree"])
    assert cfg.rollout.allocator == SegmentTreeOptions()
    cfg = load_config(None, ["rollout.allocator=segment_tree", "rollout.allocator.depth=2"])  # a YAML name, a --set below it
    assert cfg.rollout.allocator == SegmentTreeOptions(depth=2)
    cfg.rollout.allocator = "independent"  # evaluation's switch still works
    assert cfg.rollout.allocator == IndependentOptions()


OLD_AND_NEW = [
    ("independent", "n: 3", "{n: 3}"),
    ("pilot_commit", "pilots: 3, min_per_task: 1", "{pilots: 3, min_per_task: 1}"),
    ("entropy_branch", "k: 3, threshold: 0.2, in_turn: true", "{k: 3, threshold: 0.2, in_turn: true}"),
    ("segment_tree", "depth: 2, width: 3", "{depth: 2, width: 3}"),
    ("key_state", "top1_threshold: 0.7, first_tokens: 2", "{top1_threshold: 0.7, first_tokens: 2}"),
    ("contrastive", "node_decay: 0.25", "{node_decay: 0.25}"),
]


@pytest.mark.parametrize(("name", "new", "old"), OLD_AND_NEW, ids=[x[0] for x in OLD_AND_NEW])
def test_old_allocator_options_load_with_a_warning_and_build_the_same_allocator(name, new, old):
    from agentrl.rollout import make_allocator, rollout_allocator

    with pytest.warns(FutureWarning, match=r"rollout\.allocator_options is deprecated.*use rollout\.allocator: "
                      rf"\{{name: {name}, <option>: <value>\}}"):
        before = load_config(None, [f"rollout.allocator={name}", f"rollout.allocator_options={old}"])
    after = load_config(None, [f"rollout.allocator={{name: {name}, {new}}}"])
    assert before.rollout.allocator == after.rollout.allocator
    assert make_allocator(before.rollout.allocator) == make_allocator(after.rollout.allocator)
    assert rollout_allocator(before.rollout) == rollout_allocator(after.rollout)
    assert before.model_dump() == after.model_dump()


def test_old_allocator_options_alone_mean_the_default_allocator_and_never_mix_with_the_new_form():
    with pytest.warns(FutureWarning, match="rollout.allocator_options"):
        cfg = load_config(None, ["rollout.allocator_options={n: 2}"])
    assert cfg.rollout.allocator == IndependentOptions(n=2)
    with pytest.raises(ConfigError, match="give only rollout.allocator"):
        load_config(None, ["rollout.allocator={name: segment_tree}", "rollout.allocator_options={depth: 2}"])


def test_independent_plays_group_size_episodes_unless_n_says_otherwise():
    from agentrl.rollout import rollout_allocator

    r = load_config(None, ["rollout.group_size=4"]).rollout
    assert rollout_allocator(r).options.n == 4
    assert rollout_allocator(r, "segment_tree").options == SegmentTreeOptions()
    dumped = load_config(None, ["rollout.group_size=4"]).model_dump(mode="json")  # null in the dump: the same
    assert rollout_allocator(Config.model_validate(dumped).rollout).options.n == 4
    r = load_config(None, ["rollout.group_size=4", "rollout.allocator={name: independent, n: all}"]).rollout
    assert rollout_allocator(r).options.n == "all"  # the whole budget, spread
    with pytest.warns(FutureWarning):  # the old form's null meant that
        r = load_config(None, ["rollout.allocator=independent", "rollout.allocator_options={n: null}"]).rollout
    assert r.allocator == IndependentOptions(n="all")


def test_a_recorded_run_names_its_allocator_in_either_form():
    from agentrl.allocator_options import recorded_allocator

    new = load_config(None, ["rollout.allocator={name: segment_tree, depth: 2}"]).model_dump(mode="json")["rollout"]
    assert recorded_allocator(new) == ("segment_tree", {"depth": 2, "width": 2, "segment_turns": 1,
                                                         "est_leaf_cost": None})
    old = {"allocator": "segment_tree", "allocator_options": {"depth": 2}}  # a run recorded before the change
    assert recorded_allocator(old) == ("segment_tree", {"depth": 2})
    assert recorded_allocator({}) == (None, {})


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:-1", "cuda:x", "cpu cuda"])
def test_a_device_torch_would_not_parse_fails_when_the_config_loads(device):
    with pytest.raises(ConfigError, match=r"policy\.device: .*is not a device"):
        load_config(None, [f"policy.device={device}"])


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cuda", "cuda:3", "mps", "xpu:1"])
def test_device_forms_torch_parses_load(device):
    assert load_config(None, [f"policy.device={device}"]).policy.device == device


def test_a_device_this_machine_lacks_fails_naming_the_key_before_a_model_loads():
    import torch

    from agentrl.errors import PolicyError
    from agentrl.models import check_device, load_model

    check_device("cpu")
    check_device("cpu:0")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(PolicyError, match=rf"policy\.device='cuda:{count}': "):
        check_device(f"cuda:{count}")  # one past the last (none here): no CUDA, or too few devices
    with pytest.raises(PolicyError, match=rf"policy\.device='cuda:{count}'"):
        load_model("tiny-random", device=f"cuda:{count}")


@pytest.mark.parametrize(("override", "key", "why"), [
    ("sampling.temperature=1e-6", "sampling.temperature", "use 0 for greedy decoding, or at least 1e-05"),
    ("sampling.stop=['', 'END']", "sampling.stop", "an empty stop string is in every text"),
    ("train.evaluation.temperature=1e-9", "train.evaluation.temperature", "use 0 for greedy decoding"),
])
def test_sampling_values_no_backend_takes_fail_when_the_config_loads(override, key, why):
    """The backends refuse them (agentrl.policy.base.SamplingParams), so such a config failed
    every episode with a PolicyError instead of failing at once, naming the key."""
    from agentrl.train.config import load_train_config

    with pytest.raises(ConfigError, match=f"{key}: {why}"):
        load_train_config(None, [override])
    for fine in ("sampling.temperature=0", "sampling.temperature=1e-5", "train.evaluation.temperature=0.7"):
        load_train_config(None, [fine])
