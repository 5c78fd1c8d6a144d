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
    assert resolve_env_id("GuessNumber") == "agentrl/GuessNumber-v0"
    with pytest.raises(EnvError, match="must start with"):
        from agentrl.env import register_env

        register_env("GuessNumber-v1", entry_point=GuessNumberEnv)
