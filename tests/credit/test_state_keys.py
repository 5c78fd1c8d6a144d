"""ALFWorld-v0 and WebShop-v0 report ``info["state_key"]``: equal exactly when the true
state is equal, which is what GiGPO's anchor groups need (observations are not enough:
WebShop repeats the page under an "Invalid action!" message)."""

from __future__ import annotations

import pytest

from agentrl.envs.alfworld import ALFWorldEnv
from agentrl.envs.webshop import WebShopEnv


def test_alfworld_state_key_recurs_when_the_state_does():
    env = ALFWorldEnv()
    _, info = env.reset(seed=3)
    start = info["state_key"]
    assert isinstance(start, str) and 0 < len(start) <= 32
    go_a, go_b = info["admissible_actions"][:2]  # two "go to" commands
    _, _, _, _, at_a = env.step(go_a)
    _, _, _, _, at_b = env.step(go_b)
    assert len({start, at_a["state_key"], at_b["state_key"]}) == 3
    obs, _, _, _, again = env.step(go_a)  # back where we were: same key, though a later step
    assert again["state_key"] == at_a["state_key"]
    _, _, _, _, junk = env.step("fly to the moon")  # "Nothing happens.": state unchanged
    assert junk["state_key"] == at_a["state_key"]
    snap = env.snapshot()
    env.step(go_b)
    env.restore(snap)
    assert env._info()["state_key"] == at_a["state_key"]
    _, other = ALFWorldEnv().reset(seed=4)
    assert other["state_key"] != start  # another room, another key


@pytest.fixture(scope="module")
def shop() -> WebShopEnv:
    return WebShopEnv(num_products=500)


def test_webshop_state_key_ignores_messages_and_the_step_count(shop):
    _, info = shop.reset(seed=1)
    start = info["state_key"]
    obs, _, _, _, bad = shop.step("click[nothing here]")  # invalid: page unchanged
    assert obs.startswith("Invalid action!")
    assert bad["state_key"] == start
    _, _, _, _, results = shop.step(f"search[{shop.goal.query}]")
    assert results["state_key"] != start
    _, _, _, _, back = shop.step("click[back to search]")
    assert back["state_key"] == start  # the search page again, whatever was searched before
