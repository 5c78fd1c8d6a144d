"""Fuzz agentrl/WebShop-v0's step: any string gets an observation, never an exception."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.webshop import WebShopEnv

_ENV = WebShopEnv(num_products=500, max_steps=1_000)

junk = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.text(max_size=50).map(lambda s: "click[" + s + "]"),
    st.text(max_size=50).map(lambda s: "search[" + s + "]"),
    st.sampled_from(
        ["", "click[]", "search[]", "click[[next >]]", "search[" + "a b " * 25_000 + "]"]
    ),
    st.text(min_size=1, max_size=10).map(lambda s: (s * 100_000)[:100_000]),
)


@settings(deadline=None, max_examples=150)
@given(
    seed=st.integers(0, 50),
    prefix=st.integers(0, 4),
    actions=st.lists(junk, min_size=1, max_size=4),
)
def test_any_action_string_gets_an_observation(seed, prefix, actions):
    env = _ENV
    env.reset(seed=seed)
    for _ in range(prefix):  # reach results and item pages too
        env.step(env.expert_action())
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(obs, str) and obs
        assert 0.0 <= reward <= 1.0
        assert isinstance(info["admissible_actions"], list)
