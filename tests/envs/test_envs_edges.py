"""Edge cases of the built-in envs found by a hostile review: each test failed before the
fix that its commit describes. Envs whose optional extras are missing skip, saying so."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from agentrl.errors import EnvError

HAS_ALFWORLD = importlib.util.find_spec("alfworld") is not None


@pytest.mark.skipif(not HAS_ALFWORLD, reason="alfworld is not installed (pip install 'agentrl[alfworld]')")
def test_alfworld_real_finds_games_that_arrived_after_it_found_none(tmp_path):
    """A notebook session: the env is made before the data is downloaded, then again after."""
    from agentrl.envs.alfworld.real_data import DATA_FOLDER, export_games
    from agentrl.envs.alfworld.real_env import ALFWorldRealEnv
    from agentrl.envs.alfworld.scene import generate_scene

    export_games([generate_scene(0, "train")], tmp_path / "download")
    train = tmp_path / "data" / DATA_FOLDER / "train"
    train.mkdir(parents=True)
    with pytest.raises(EnvError, match="no solvable game"):
        ALFWorldRealEnv(split="train", data_dir=str(tmp_path / "data"), oracle=None)
    shutil.copytree(tmp_path / "download" / DATA_FOLDER / "train", train, dirs_exist_ok=True)
    env = ALFWorldRealEnv(split="train", data_dir=str(tmp_path / "data"), oracle=None)
    assert env.num_tasks == 1
    env.close()


@pytest.mark.parametrize("kinds", [[], ()], ids=["list", "tuple"])
def test_math_python_refuses_an_empty_list_of_kinds_as_alfworld_refuses_no_families(kinds):
    from agentrl.envs.tooltasks.math_python import MathPythonEnv

    with pytest.raises(EnvError, match="kinds"):
        MathPythonEnv(kinds=kinds)
