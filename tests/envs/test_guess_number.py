"""GuessNumber: the built-in env that runs everything end to end."""

from __future__ import annotations

import math

import pytest

from agentrl.env import make_env, resolve_env_id
from agentrl.envs import GuessNumberEnv
from agentrl.errors import EnvError


@pytest.mark.parametrize("high", [1, 7, 32, 100])
def test_expert_always_wins_within_log2_turns(high):
    env = GuessNumberEnv(high=high, max_turns=16)
    for seed in range(200):
        env.reset(seed=seed)
        terminated = truncated = False
        while not (terminated or truncated):
            _, reward, terminated, truncated, _ = env.step(env.expert_action())
        assert terminated and reward == 1.0 and not truncated
        assert env.turn <= math.ceil(math.log2(high)) + 1


def test_hints_and_invalid_guesses():
    env = GuessNumberEnv(high=10, max_turns=3)
    env.reset(seed=0)
    secret = env.secret
    obs, r, term, trunc, info = env.step("banana")
    assert "Invalid guess" in obs and r == 0 and not term and not trunc
    low = secret - 1 if secret > 1 else None
    if low:
        obs, *_ = env.step(f"I guess {low}")
        assert "too low" in obs
        assert info is not None and env.low_bound == low + 1
    obs, r, term, trunc, _ = env.step("0")
    if not term:
        assert trunc and "Out of guesses" in obs


def test_same_seed_same_secret_different_seed_varies():
    env = GuessNumberEnv(high=1000)
    secrets = set()
    for seed in range(20):
        env.reset(seed=seed)
        a = env.secret
        env.reset(seed=seed)
        assert env.secret == a
        secrets.add(a)
    assert len(secrets) > 10


def test_unknown_env_suggests_the_closest_id():
    with pytest.raises(EnvError, match="Did you mean 'agentrl/GuessNumber-v0'") as e:
        make_env("agentrl/GuesNumber-v0")
    assert "Registered envs:" in str(e.value)
    assert "env.imports" in str(e.value)  # says how to make an env of one's own visible
    assert resolve_env_id("GuessNumber") == "agentrl/GuessNumber-v0"
    from agentrl.env import register_env

    with pytest.raises(EnvError, match="must look like '<namespace>/<Name>-v0'"):
        register_env("GuessNumber-v1", entry_point=GuessNumberEnv)


def test_register_env_accepts_a_namespace_of_ones_own():
    from agentrl.env import list_envs, register_env

    register_env("myorg/GuessNumberOwn-v0", entry_point=GuessNumberEnv)
    assert "myorg/GuessNumberOwn-v0" in list_envs()
    assert resolve_env_id("GuessNumberOwn") == "myorg/GuessNumberOwn-v0"
    assert make_env("myorg/GuessNumberOwn-v0").unwrapped.__class__ is GuessNumberEnv


def test_state_key_names_the_interval_left_and_the_guesses_used():
    """GiGPO's anchor state: different histories that leave the same interval meet in one state."""
    seed = next(s for s in range(100) if _secret(s) >= 8)
    secret = _secret(seed)
    envs = [GuessNumberEnv(high=16, max_turns=4) for _ in range(4)]
    keys = [e.reset(seed=seed)[1]["state_key"] for e in envs]
    assert keys == ["turn 0: 1..16"] * 4
    keys = [e.step(a)[4]["state_key"] for e, a in zip(envs, ["1", "3", str(secret - 1), "one"], strict=True)]
    assert keys == ["turn 1: 2..16", "turn 1: 4..16", f"turn 1: {secret}..16", "turn 1: 1..16"]
    # Two different histories, the same interval after the same number of guesses: one state.
    assert envs[0].step("3")[4]["state_key"] == envs[3].step("3")[4]["state_key"] == "turn 2: 4..16"
    assert envs[1].step("banana")[4]["state_key"] == "turn 2: 4..16"


def _secret(seed: int) -> int:
    env = GuessNumberEnv(high=16)
    env.reset(seed=seed)
    return env.secret
