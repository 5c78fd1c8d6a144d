"""A config file's paths read environment variables as a shell does: YAML keeps ``$SCRATCH``
as text, and ``out_dir: $SCRATCH/runs`` made a folder named '$SCRATCH' in the working directory."""

from __future__ import annotations

import pytest
import yaml

from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config

KEYS = {"rollout.out_dir": lambda c: c.rollout.out_dir, "train.output.dir": lambda c: c.train.output.dir,
        "policy.model": lambda c: c.policy.model}


def _from_file(tmp_path, key: str, value: str):
    section, leaf = key.rsplit(".", 1)
    data: dict = {}
    cur = data
    for part in section.split("."):
        cur = cur.setdefault(part, {})
    cur[leaf] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_train_config(path)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("written", ["$AGENTRL_TEST_SCRATCH/runs/x", "${AGENTRL_TEST_SCRATCH}/runs/x"])
def test_a_variable_in_a_path_is_its_value(tmp_path, monkeypatch, key, written):
    monkeypatch.setenv("AGENTRL_TEST_SCRATCH", "/scratch/me")
    assert KEYS[key](_from_file(tmp_path, key, written)) == "/scratch/me/runs/x"


@pytest.mark.parametrize("key", KEYS)
def test_an_unset_variable_in_a_path_is_an_error_naming_the_key_and_the_variable(tmp_path, monkeypatch, key):
    """A shell makes it empty, and ``$SCRATCH/runs`` then writes to /runs."""
    monkeypatch.delenv("AGENTRL_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=rf"{key}: \$AGENTRL_TEST_UNSET is not set"):
        _from_file(tmp_path, key, "$AGENTRL_TEST_UNSET/runs")


def test_a_home_folder_and_a_variable_together(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AGENTRL_TEST_RUN", "r1")
    assert _from_file(tmp_path, "train.output.dir", "~/runs/$AGENTRL_TEST_RUN").train.output.dir == \
        str(tmp_path / "runs" / "r1")
