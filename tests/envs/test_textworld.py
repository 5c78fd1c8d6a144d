"""agentrl/TextWorld-v0: real TextWorld games, generated on demand and cached.

Tests that play games need the optional ``textworld`` package and skip, saying
so, without it. Games are generated once per test session into a temp cache.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.env import list_envs, make_env
from agentrl.envs.textworld import GameSpec, TextWorldEnv, clean_command, game_file
from agentrl.envs.textworld.env import meta_verb
from agentrl.envs.textworld.games import require_textworld, stale_games
from agentrl.errors import EnvError

HAS_TEXTWORLD = importlib.util.find_spec("textworld") is not None
needs_textworld = pytest.mark.skipif(
    not HAS_TEXTWORLD, reason="textworld is not installed (pip install 'agentrl[textworld]')"
)


@pytest.fixture(scope="session")
def tw_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("textworld-cache")


@pytest.fixture()
def env(tw_cache):
    environment = TextWorldEnv(cache_dir=tw_cache)
    yield environment
    environment.close()


def test_registered_without_importing_textworld():
    assert "agentrl/TextWorld-v0" in list_envs()


def test_missing_textworld_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textworld", None)  # import now fails
    with pytest.raises(EnvError, match="pip install textworld"):
        require_textworld()
    with pytest.raises(EnvError, match=r"agentrl\[textworld\]"):
        TextWorldEnv()


def test_clean_command_strips_junk_and_bounds_length():
    assert clean_command("  take\x00 the\n\tkey \x7f") == "take the key"
    assert len(clean_command("a" * 100_000)) == 190
    assert clean_command("\x01\x02") == ""
    assert clean_command("\\c look\\") == "c look"  # dumb-frotz's escape character


def test_meta_verb_finds_interpreter_verbs_in_any_clause():
    for command in ["save", "SAVE.", "look, save", "look,restore", "look then restart",
                    "x me. script notes.txt", "transcript on", "q", "look; quit",
                    "look. transcripts", "TRANSCRIPTION", "print_state", "print_statement",
                    "enable print state option", "tw-extra-infos description", "tw-foo"]:
        assert meta_verb(command) is not None, command
    for command in ["take script", "examine save", "go south", "quilt", "open the saved box",
                    "saves", "quitting", "print", "tw"]:
        assert meta_verb(command) is None, command


@needs_textworld
def test_a_leading_backslash_gets_an_observation(env, tw_cache):
    # dumb-frotz loops forever on a line that starts with "\\", inside C, where pytest-timeout's
    # signal never lands: hence a child process with a deadline.
    env.reset(seed=1)  # the game is cached for the child
    child = (
        "import sys; from agentrl.envs.textworld import TextWorldEnv\n"
        "env = TextWorldEnv(cache_dir=sys.argv[1]); env.reset(seed=1)\n"
        "print(repr(env.step('\\\\c 3 #F')[0]), repr(env.step(' \\\\help')[0]))\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(tw_cache)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not a verb" in done.stdout and "DUMB-FROTZ" not in done.stdout


@needs_textworld
def test_interpreter_verbs_are_refused_and_touch_no_file(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where "save" and "script" wrote
    env.reset(seed=1)
    start = env.step("look")[0]
    assert "go south" in env.step("look")[4]["admissible_actions"]
    env.step("go south")
    moved = env.step("look")[0]
    assert moved != start
    for command in ["save", "look, save", "look then restore", "x me. script notes.txt",
                    "look. transcripts", "print_state", "enable print state option",
                    "tw-extra-infos description", "restart", "yes", "quit", "yes"]:
        obs, reward, terminated, truncated, info = env.step(command)
        assert reward == 0.0 and not terminated and info["admissible_actions"], command
        assert "is not available" in obs or command == "yes", (command, obs)
        assert "STATE START" not in obs and "<description>" not in obs
    assert list(tmp_path.iterdir()) == []
    assert env.step("look")[0] == moved  # neither restarted nor restored, and nothing appended


@needs_textworld
def test_oracle_wins_generated_games(env, tw_cache):
    home = os.environ.get("HOME")
    for seed in (1, 2):
        obs, info = env.reset(seed=seed)
        assert obs and info["instruction"] and info["admissible_actions"]
        assert info["tools"] == []
        total, terminated, truncated, steps = 0.0, False, False, 0
        while not (terminated or truncated):
            action = env.oracle_action()
            assert action in info["admissible_actions"]
            _, reward, terminated, truncated, info = env.step(action)
            total += reward
            steps += 1
        assert terminated and info["success"] and info["won"]
        assert total == pytest.approx(1.0)
        assert steps <= GameSpec().quest_length + 2
    assert os.environ.get("HOME") == home  # restored after compiling
    assert (tw_cache / "Inform").is_dir()  # the compiler wrote under the cache, not ~


@needs_textworld
def test_games_are_cached_and_seeds_are_reproducible(env, tw_cache, tmp_path):
    first, _ = env.reset(seed=1)
    path = game_file(GameSpec(), 1, tw_cache)
    inode = path.stat().st_ino  # a hit marks the file used (its mtime) but does not rewrite it
    again, _ = env.reset(seed=1)
    assert again == first and path.stat().st_ino == inode
    fresh = TextWorldEnv(cache_dir=tmp_path)
    try:
        assert fresh.reset(seed=1)[0] == first  # regenerated elsewhere: the same game
    finally:
        fresh.close()


@needs_textworld
def test_restored_env_continues_identically(env):
    env.reset(seed=2)
    env.step("look")
    env.step("inventory")
    snap = env.snapshot()
    actions = ["look", env.oracle_action(), "take nothing", "inventory"]
    first = [env.step(a) for a in actions]
    env.reset(seed=1)
    env.restore(snap)
    assert [env.step(a) for a in actions] == first


# The cache holds at most max_cached_games games, dropping the least recently used: without
# a seed every reset compiled a new game and the folder grew without bound (about 400 kB a
# game). The tiniest games still take 1-4 s to compile here, hence few resets and a cap of 2.
TINY = {"nb_rooms": 1, "nb_objects": 1, "quest_length": 1}


def _games(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.z8")}


def test_stale_games_are_those_past_the_cap_by_last_use_oldest_first(tmp_path):
    spec = GameSpec(**TINY)
    for seed, mtime in [(1, 500), (2, 100), (3, 400), (4, 200), (5, 300)]:
        path = tmp_path / f"{spec.key(seed)}.z8"
        path.write_bytes(b"")
        os.utime(path, ns=(mtime, mtime))
    (tmp_path / "notes.z8").write_bytes(b"")  # not a name the cache gives: not counted, never dropped
    assert [p.stem for p in stale_games(tmp_path, 2)] == [spec.key(2), spec.key(4), spec.key(5)]
    assert stale_games(tmp_path, 2, keep=tmp_path / f"{spec.key(2)}.z8")[0].stem == spec.key(4)
    assert stale_games(tmp_path, 5) == []


@needs_textworld
@pytest.mark.timeout(300)
def test_unseeded_resets_leave_at_most_the_cap_of_games_on_disk(tmp_path):
    env = TextWorldEnv(**TINY, cache_dir=tmp_path, max_cached_games=2)
    try:
        seen = set()
        for _ in range(5):
            obs, info = env.reset()
            assert info["admissible_actions"]
            seen.add(env.snapshot().game_file)
            assert len(_games(tmp_path)) <= 2
        assert len(seen) == 5  # each reset drew a new game from the env's generator
        assert _games(tmp_path) == {p.stem for p in tmp_path.glob("*.json")}  # whole games only
    finally:
        env.close()


@needs_textworld
@pytest.mark.timeout(300)
def test_the_cache_drops_the_least_recently_used_game_and_restore_rebuilds_it(tmp_path):
    env = TextWorldEnv(**TINY, cache_dir=tmp_path, max_cached_games=2)
    key = GameSpec(**TINY).key
    try:
        env.reset(seed=1)
        env.step("look")
        snap = env.snapshot()
        actions = ["inventory", env.oracle_action()]
        after = [env.step(a) for a in actions]
        env.reset(seed=2)
        env.reset(seed=1)  # used again: seed 2's game is now the oldest
        env.reset(seed=3)
        assert _games(tmp_path) == {key(1), key(3)}
        env.reset(seed=4)
        assert _games(tmp_path) == {key(3), key(4)}
        env.restore(snap)  # its game was dropped: built again from its spec and seed
        assert [env.step(a) for a in actions] == after
        assert key(1) in _games(tmp_path) and len(_games(tmp_path)) == 2
    finally:
        env.close()


@needs_textworld
def test_step_limit_truncates_inside_the_env(tw_cache):
    env = TextWorldEnv(cache_dir=tw_cache, max_steps=2)
    try:
        env.reset(seed=1)
        assert env.step("look")[3] is False
        _, _, terminated, truncated, info = env.step("look")
        assert truncated and not terminated and info["admissible_actions"] == []
    finally:
        env.close()


@needs_textworld
def test_made_through_make_env(tw_cache):
    env = make_env("agentrl/TextWorld-v0", cache_dir=tw_cache)
    try:
        obs, info = env.reset(seed=1)
        assert set(info) >= {"instruction", "admissible_actions", "tools"}
    finally:
        env.close()


junk = st.one_of(
    st.text(max_size=100),
    st.binary(max_size=100).map(lambda b: b.decode("latin-1")),
    st.just(""),
    st.text(min_size=1, max_size=8).map(lambda s: (s * 100_000)[:100_000]),
)


@needs_textworld
@settings(
    deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=st.lists(junk, min_size=1, max_size=3))
def test_any_action_string_gets_an_observation(env, actions):
    env.reset(seed=1)
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(obs, str) and obs
        assert isinstance(info["admissible_actions"], list)
