"""From a hostile review of the config: values that validated but meant nonsense."""

from __future__ import annotations

import warnings

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config


def _load(override: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return load_train_config(None, [override])


@pytest.mark.parametrize("key", [
    "sampling.temperature",           # logits / inf: every token equally likely
    "train.optimizer.lr",             # the first step makes every weight inf or NaN
    "train.optimizer.weight_decay",
    "train.lora.alpha",
    "train.evaluation.temperature",
    "distributed.env_worker_cpus",
    "rollout.episode_timeout_s",      # null is the no-limit value
    "train.asynchronous.batch_timeout_s",
    "train.loss.clip_high",           # the option sections share the config's base (agentrl.strict)
    "train.loss.kl_coef",
    "train.loss.tis_cap",
    "train.loss.entropy_coef",
    "train.value_head.l2",
])
def test_an_infinite_setting_is_an_error_naming_its_key(key):
    """``.inf`` passed every ``ge``/``gt`` bound and loaded; the run then sampled uniformly
    (temperature) or trained to NaN (lr)."""
    override = f"{key}=.inf" if not key.startswith("train.asynchronous") else "train.asynchronous={batch_timeout_s: .inf}"
    with pytest.raises(ConfigError, match=rf"{key}: Input should be a finite number"):
        _load(override)


@pytest.mark.parametrize(("override", "key"), [
    ("rollout.episodes=true", "rollout.episodes"),
    ("train.steps=true", "train.steps"),
    ("policy.prefix_cache_mb=false", "policy.prefix_cache_mb"),
    ("train.optimizer.lr=true", "train.optimizer.lr"),
    ("rollout.budget=yes", "rollout.budget"),          # YAML 1.1: yes is true
    ("train.task_seeds=[1, true]", "train.task_seeds"),
    ("train.loss.kl_coef=true", "train.loss.kl_coef"),
    ("train.value_head.l2=true", "train.value_head.l2"),
    ("train.distill={teacher: tiny-random, weight: true}", "train.distill.weight"),
    ("train.credit={name: grpo, eps: true}", "train.credit: eps"),  # a named method's options
    ("rollout.allocator={name: segment_tree, depth: true}", "rollout.allocator: depth"),
])
def test_a_boolean_where_a_number_goes_is_an_error_naming_its_key(override, key):
    """pydantic's lax mode read true as 1 and false as 0: ``episodes: yes`` ran one task."""
    with pytest.raises(ConfigError, match=rf"{key}: expected a number, got (true|false)"):
        _load(override)


def test_booleans_still_load_where_the_key_takes_one():
    cfg = _load("train.compile=true")
    assert cfg.train.compile is True
    cfg = load_config(overrides=["rollout.record_expert_actions=true", "rollout.deterministic=false",
                                 "rollout.episodes=3", "sampling.temperature=0"])
    assert cfg.rollout.record_expert_actions is True and cfg.rollout.deterministic is False
    assert cfg.rollout.episodes == 3


@pytest.mark.parametrize("betas", ["[1.5, 0.999]", "[0.9, 1.0]", "[-0.1, 0.999]"])
def test_adamw_betas_outside_0_to_1_fail_when_the_config_loads(betas):
    """torch's AdamW refused them only when the optimizer was built, after the model loaded
    (and the SFT data was collected), with a ValueError that named no key."""
    with pytest.raises(ConfigError, match=r"train\.optimizer\.betas: each beta must be in \[0, 1\)"):
        _load(f"train.optimizer.betas={betas}")
    assert _load("train.optimizer.betas=[0.0, 0.95]").train.optimizer.betas == (0.0, 0.95)


@pytest.mark.parametrize("key", ["train.evaluation.task_seeds", "sft.task_seeds"])
def test_an_empty_list_of_task_seeds_is_an_error_not_the_default_seeds(key):
    """``[]`` read as 'not given': evaluation played the 16 default held-out seeds and SFT
    sft.episodes seeds, where train.task_seeds=[] was already an error."""
    with pytest.raises(ConfigError, match=rf"{key}: give at least one seed, or null"):
        _load(f"{key}=[]")


@pytest.mark.parametrize(("override", "read"), [
    ("rollout.out_dir=~/runs/r", lambda c: c.rollout.out_dir),
    ("train.output.dir=~/runs/t", lambda c: c.train.output.dir),
    ("policy.model=~/models/m", lambda c: c.policy.model),
])
def test_a_path_under_home_in_a_config_means_the_home_folder(tmp_path, monkeypatch, override, read):
    """YAML does not expand ``~`` as a shell does: ``out_dir: ~/runs/r`` made a folder named
    '~' in the working directory, and ``model: ~/models/m`` was an unknown model."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = override.split("=", 1)[1]
    assert read(_load(override)) == str(tmp_path / path.removeprefix("~/"))


@pytest.mark.parametrize(("override", "want"), [
    ("rollout.system_prompt=Reply: with the action", "Reply: with the action"),  # was a mapping, refused
    ("rollout.system_prompt=Call tool #1 first", "Call tool #1 first"),          # was cut to 'Call tool'
    ("rollout.system_prompt=#1 rule: act", "#1 rule: act"),                      # was null: the template's default
    ("rollout.out_dir=runs/try #2", "runs/try #2"),
    ("rollout.system_prompt=- one step at a time", "- one step at a time"),       # was a list
])
def test_override_text_that_yaml_would_read_otherwise_stays_as_written(override, want):
    """``--set key=value`` reads the value as YAML, so a system prompt with ': ' became a mapping
    and ' #' started a comment that cut the text, silently."""
    key = override.split("=", 1)[0]
    cfg = load_config(overrides=[override])
    assert cfg.model_dump()[key.split(".")[0]][key.split(".")[1]] == want


def test_overrides_still_read_yaml_values():
    cfg = load_config(overrides=["env.kwargs={high: 8}", "sampling.stop=[x, 'y z']", "rollout.system_prompt=null",
                                 "rollout.episodes=3", "sampling.temperature=0.5", "rollout.deterministic=true",
                                 "policy.model='quoted: text'"])
    assert cfg.env.kwargs == {"high": 8} and cfg.sampling.stop == ["x", "y z"]
    assert cfg.rollout.system_prompt is None and cfg.rollout.episodes == 3 and cfg.sampling.temperature == 0.5
    assert cfg.rollout.deterministic is True and cfg.policy.model == "quoted: text"


def test_a_mock_policy_with_no_responses_is_an_error_naming_the_key():
    """policy.mock_responses=[] loaded, and every episode failed 'generation failed'."""
    with pytest.raises(ConfigError, match=r"policy\.mock_responses: List should have at least 1 item"):
        load_config(overrides=["policy.backend=mock", "policy.mock_responses=[]"])


@pytest.mark.parametrize("override", [
    "rollout.seed=-1", "train.task_seed_start=-4", "train.task_seeds=[3, -1]", "train.seed=-1",
    "train.evaluation.seed_start=-1", "train.evaluation.task_seeds=[-2]", "sft.seed_start=-1",
    "sft.task_seeds=[0, -1]"])
def test_a_negative_seed_is_an_error_naming_its_key(override):
    """gymnasium refuses a negative seed in Env.reset: the config loaded, and each episode on
    one failed 'env.reset raised Error', counted as an env failure."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}(\.\d+)?: a seed is >= 0 \(gymnasium's Env.reset refuses"):
        _load(override)


def test_an_override_under_an_empty_section_sets_a_key_of_it(tmp_path):
    """A file's section left empty (``train:`` with its keys commented out) or null
    (``distributed: null``) is None: ``--set train.steps=3`` said 'train: is a value, cannot
    set train.steps'."""
    from agentrl.train.config import TrainRunConfig

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  # steps: 20\ndistributed: null\n")
    cfg = load_config(path, ["train.steps=3", "distributed.num_env_workers=3"], schema=TrainRunConfig)
    assert cfg.train.steps == 3 and cfg.distributed is not None and cfg.distributed.num_env_workers == 3
    with pytest.raises(ConfigError, match=r"rollout\.seed: is a value, cannot set rollout\.seed\.x"):
        load_config(overrides=["rollout.seed=1", "rollout.seed.x=2"])


@pytest.mark.parametrize("key", ["env_worker_cpus", "rollout_worker_cpus", "rollout_worker_gpus"])
def test_a_worker_share_below_what_ray_counts_is_an_error_naming_its_key(key):
    """Ray counts resources in units of 0.0001: 0.00001 CPUs loaded, then failed at the workers' start
    with a ValueError that named no key."""
    with pytest.raises(ConfigError, match=rf"distributed.{key}: .*1e-05 is below 0.0001"):
        load_config(overrides=[f"distributed={{{key}: 0.00001}}"])
    assert getattr(load_config(overrides=[f"distributed={{{key}: 0.0001}}"]).distributed, key) == 0.0001
