"""``agentrl/ALFWorldReal-v0`` on a small folder in ALFWorld's own layout.

The folder is written by ``real_data.export_games`` from our procedural scenes
(problems from ``pddl_export``, alfworld's bundled domain and grammar), so the
real engine loads real-format games offline. Needs the ``alfworld`` extra;
without it every test is skipped with the reason.
"""

from __future__ import annotations

import json
import math
import random
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.env import make_env
from agentrl.envs.alfworld.real_data import FAMILIES, data_root, export_games, list_games
from agentrl.envs.alfworld.real_engine import RealEngine, available
from agentrl.envs.alfworld.scene import generate_scene
from agentrl.errors import EnvError

pytestmark = pytest.mark.skipif(
    not available(), reason="alfworld is not installed (pip install 'agentrl[alfworld]'); real-games env skipped")

# Seeds whose tasks cover all six families in valid_unseen, and a few in the other splits.
SEEDS = {"valid_unseen": (0, 1, 2, 3, 4, 8), "valid_seen": (0, 1), "train": (0, 1, 2)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("alfworld_data")
    export_games([generate_scene(s, split) for split, seeds in SEEDS.items() for s in seeds], root)
    return root


def _make(data, split="valid_unseen", **kwargs):
    return make_env("agentrl/ALFWorldReal-v0", split=split, data_dir=str(data), **kwargs)


def _play_oracle(env, seed):
    obs, info = env.reset(seed=seed)
    inner = env.unwrapped
    for _ in range(inner.max_steps):
        obs, reward, terminated, truncated, info = env.step(inner.oracle_action())
        if terminated or truncated:
            return reward, terminated, info
    raise AssertionError("the episode did not end within max_steps")


def test_without_data_the_error_names_the_layout_and_alfworlds_tool(tmp_path, monkeypatch):
    with pytest.raises(EnvError) as err:
        make_env("agentrl/ALFWorldReal-v0", data_dir=str(tmp_path))
    msg = str(err.value)
    assert "json_2.1.1/{train,valid_seen,valid_unseen}" in msg and "game.tw-pddl" in msg
    assert "alfworld-download" in msg and "ALFWORLD_DATA" in msg
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(EnvError, match="nowhere"):
        make_env("agentrl/ALFWorldReal-v0", split="valid_unseen")


def test_split_lists_solvable_games_sorted_with_the_family_from_the_path(data, tmp_path):
    games = list_games(data_root(data), "valid_unseen")
    assert [g.name for g in games] == sorted(g.name for g in games)
    assert sorted(g.family for g in games) == sorted(FAMILIES)
    assert all(g.task_dir.startswith(g.family + "-") for g in games)
    assert list_games(data_root(data), "eval_out_of_distribution") == games  # ALFWorld's config name
    assert len(list_games(data_root(data / "json_2.1.1"), "train")) == 3  # the json_2.1.1 folder works too
    # ALFWorld's filter: movable and sliced trials, unsolvable games and unknown families are left out
    export_games([generate_scene(0, "valid_seen")], tmp_path)
    (good,) = list(tmp_path.glob("json_2.1.1/valid_seen/*/*/game.tw-pddl"))
    for name, solvable in (("pick_and_place_simple-Knife-None-movable-1", True),
                           ("pick_and_place_simple-AppleSliced-None-Fridge-2", True),
                           ("pick_and_place_simple-Mug-None-Desk-3", False),
                           ("slice_and_serve-Mug-None-Desk-4", True)):
        trial = tmp_path / "json_2.1.1" / "valid_seen" / name / "trial_T1"
        trial.mkdir(parents=True)
        game = json.loads(good.read_text()) | {"solvable": solvable}
        (trial / "game.tw-pddl").write_text(json.dumps(game))
        (trial / "traj_data.json").write_text("{}")
    assert [g.path for g in list_games(data_root(tmp_path), "valid_seen")] == [good]


def test_the_handcoded_expert_of_the_real_games_wins_every_family(data):
    env = _make(data)
    assert env.unwrapped.num_tasks == 6
    won = {}
    for seed in range(6):
        reward, terminated, info = _play_oracle(env, seed)
        won[info["task_type"]] = (reward, terminated, info["success"])
    assert won == dict.fromkeys(FAMILIES, (1.0, True, True))


def test_the_planner_oracle_wins_too(data):
    env = _make(data, split="train", oracle="planner")
    for seed in range(3):
        reward, terminated, info = _play_oracle(env, seed)
        assert (reward, terminated, info["won"]) == (1.0, True, True), info["game"]


def test_text_is_the_real_engines_own(data):
    """Observation and admissible commands equal those of the engine loaded with the same problem."""
    env = _make(data, split="train")
    scene = generate_scene(1, "train")
    (game,) = [g for g in env.unwrapped.games if g.trial.endswith("_000001")]
    obs, info = env.reset(options={"game": game.path})
    real = RealEngine(scene)
    real_obs, real_adm, _ = real.reset()
    assert obs == real_obs and info["admissible_actions"] == real_adm
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-") and info["instruction"] == scene.task.goal
    assert info["task_type"] == scene.task.family and info["game"].startswith("train/" + scene.task.family)
    rng = random.Random(0)
    for command in ["Go to nowhere", "look."] + [None] * 8:
        command = command or rng.choice(info["admissible_actions"])
        obs, _, _, _, info = env.step(command)
        real_obs, real_adm, _ = real.step(command)
        assert obs == real_obs and info["admissible_actions"] == real_adm
    assert "The expert's plan: " in env.reset(seed=0)[1]["privileged"]


def test_the_engine_leaves_sys_argv_as_it_was(data):
    """fast-downward's translator overwrites sys.argv; every engine call puts it back."""
    argv = list(sys.argv)
    env = _make(data, split="valid_seen")
    env.reset(seed=1)
    env.step("look")
    assert sys.argv == argv


def test_not_admissible_text_is_nothing_happens_and_uses_the_step(data):
    env = _make(data, max_steps=3)
    _, info = env.reset(seed=0)
    obs, *_, info = env.step(info["admissible_actions"][0])
    assert obs != "Nothing happens." and info["invalid_action"] is False
    env.reset(seed=0)
    for i, junk in enumerate(["GO TO CABINET 1", "jump", ""]):
        obs, reward, terminated, truncated, info = env.step(junk)
        assert obs == "Nothing happens." and reward == 0.0 and not terminated and info["invalid_action"] is True
        assert truncated == (i == 2)
    obs, reward, terminated, truncated, info = env.step("look")
    assert "episode is over" in obs and info["admissible_actions"] == []


def _trace(env, actions):
    out = []
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        out.append((obs, reward, terminated, truncated, info["admissible_actions"], info["state_key"]))
    return out


def test_restored_env_continues_identically(data):
    env = _make(data, split="train")
    _, info = env.reset(seed=2)
    rng = random.Random(3)
    for _ in range(6):
        _, _, _, _, info = env.step(rng.choice(info["admissible_actions"]))
    env.step("not a command")  # a step that changes nothing is not replayed, but counts
    snap = env.unwrapped.snapshot()
    key = info["state_key"]
    plan = env.unwrapped.oracle_action()
    later = [rng.choice(info["admissible_actions"]), "look", "inventory"]
    first = _trace(env, later)
    env.unwrapped.restore(snap)
    assert env.unwrapped.oracle_action() == plan
    assert _trace(env, later) == first
    other = _make(data, split="train")
    other.reset(seed=0)  # another game loaded: restore switches back
    other.unwrapped.restore(snap)
    assert other.unwrapped._state_key() == key
    assert _trace(other, later) == first
    # the step count came along: truncation falls where it would have
    assert other.unwrapped._steps == env.unwrapped._steps


def test_restore_then_the_oracle_still_wins(data):
    env = _make(data)
    env.reset(seed=4)
    inner = env.unwrapped
    for _ in range(3):
        env.step(inner.oracle_action())
    snap = inner.snapshot()
    reward, terminated, _ = None, False, None
    for _ in range(3):
        env.step("look")
    inner.restore(snap)
    for _ in range(inner.max_steps):
        _, reward, terminated, truncated, _ = env.step(inner.oracle_action())
        if terminated or truncated:
            break
    assert terminated and reward == 1.0


def test_state_key_depends_on_the_state_not_the_path(data):
    env = _make(data, split="train")
    _, info = env.reset(seed=0)
    start = info["state_key"]
    a, b = [c for c in info["admissible_actions"] if c.startswith("go to")][:2]
    via_a = _trace(env, [a, b])[-1][-1]
    env.reset(seed=0)
    direct = _trace(env, [b])[-1][-1]
    assert via_a == direct != start
    env.reset(seed=0)
    assert _trace(env, [a])[-1][-1] != direct
    _, info = env.reset(seed=1)
    assert info["state_key"] != start  # another game


def test_options_pick_a_game_by_index_or_path_and_families_filter(data):
    env = _make(data)
    games = env.unwrapped.games
    _, info = env.reset(options={"game": 2})
    assert info["game"] == games[2].name
    _, info = env.reset(options={"game": str(games[3].path)})
    assert info["game"] == games[3].name
    with pytest.raises(EnvError, match="out of range"):
        env.reset(options={"game": 99})
    looks = _make(data, families=["look_at_obj_in_light"])
    assert looks.unwrapped.num_tasks == 1 and looks.unwrapped.task_family(7) == "look_at_obj_in_light"
    with pytest.raises(EnvError, match="families: unknown 'dance'"):
        _make(data, families=["dance"])
    no_oracle = _make(data, oracle=None)
    no_oracle.reset(seed=0)
    with pytest.raises(EnvError, match="oracle=None"):
        no_oracle.unwrapped.oracle_action()


JUNK = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", " ", "\x00", "go to", "take  from ", "x" * 10_000, "move to", "look\nlook"]),
)


def test_junk_actions_never_crash(data):
    env = _make(data, split="valid_seen", max_steps=6)

    @settings(deadline=None, max_examples=15, suppress_health_check=list(HealthCheck))
    @given(actions=st.lists(JUNK | st.integers(0, 30), min_size=1, max_size=6))
    def run(actions):
        _, info = env.reset(seed=len(actions))
        for a in actions:
            if isinstance(a, int):  # now and then a real command, to move the state on
                adm = info["admissible_actions"]
                a = adm[a % len(adm)] if adm else "look"
            obs, reward, terminated, truncated, info = env.step(a)
            assert isinstance(obs, str) and obs
            assert isinstance(reward, float) and math.isfinite(reward)
            if terminated or truncated:
                break

    run()
