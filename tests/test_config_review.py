"""From a hostile review of the config: values that validated but meant nonsense."""

from __future__ import annotations

import warnings

import pytest

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
])
def test_an_infinite_setting_is_an_error_naming_its_key(key):
    """``.inf`` passed every ``ge``/``gt`` bound and loaded; the run then sampled uniformly
    (temperature) or trained to NaN (lr)."""
    override = f"{key}=.inf" if not key.startswith("train.asynchronous") else "train.asynchronous={batch_timeout_s: .inf}"
    with pytest.raises(ConfigError, match=rf"{key}: Input should be a finite number"):
        _load(override)
