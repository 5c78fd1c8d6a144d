"""agentrl/WebShop-v0: catalog, search, pages, score, expert, snapshots."""

from __future__ import annotations

import random

import pytest

from agentrl.env import make_env
from agentrl.envs.webshop import (
    WebShopEnv,
    get_catalog,
    make_goal,
    satisfies,
    score_purchase,
)
from agentrl.envs.webshop.catalog import build_catalog
from agentrl.errors import EnvError

SMALL = 2_000


@pytest.fixture(scope="module")
def env() -> WebShopEnv:
    return WebShopEnv(num_products=SMALL)


def _play(env: WebShopEnv, actions: list[str]) -> list[tuple]:
    out = []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        out.append((obs, reward, terminated, truncated, info))
    return out


def test_catalog_is_deterministic_and_complete():
    a, b = build_catalog(7, 300), build_catalog(7, 300)
    assert [p.title for p in a.products] == [p.title for p in b.products]
    assert [p.price for p in a.products] == [p.price for p in b.products]
    assert build_catalog(8, 300).products[0] != a.products[0]
    assert len({p.asin for p in a.products}) == 300
    assert len({p.category for p in a.products}) >= 5
    for p in a.products:
        assert p.title and p.description and p.features and p.attributes and p.options
        assert p.price > 0 and all(len(v) >= 2 for v in p.options.values())


def test_default_catalog_has_ten_thousand_products_and_is_shared():
    first = WebShopEnv()
    second = WebShopEnv()
    assert len(first.catalog) >= 10_000
    assert first.catalog is second.catalog is get_catalog(0, 10_000)


def test_search_ranks_products_of_the_asked_type_first(env):
    rng = random.Random(0)
    for _ in range(20):
        goal = make_goal(env.catalog, rng)
        hits = env.catalog.search(goal.query)
        assert 0 < len(hits) <= 50
        assert env.catalog.products[hits[0]].product_type == goal.product_type
    assert env.catalog.search("") == ()
    assert env.catalog.search("qqqq zzzz") == ()


def test_instruction_names_type_attributes_options_and_price(env):
    rng = random.Random(1)
    for _ in range(50):
        goal = make_goal(env.catalog, rng)
        target = env.catalog.products[env.catalog.by_asin[goal.asin]]
        assert goal.product_type in goal.instruction
        assert all(a in goal.instruction for a in goal.attributes)
        assert all(v in goal.instruction for _, v in goal.options)
        assert f"price lower than {goal.price_upper:.2f} dollars" in goal.instruction
        assert satisfies(goal, target)


def test_score_follows_the_webshop_formula(env):
    goal = make_goal(env.catalog, random.Random(3))
    target = env.catalog.products[env.catalog.by_asin[goal.asin]]
    right = dict(goal.options)
    assert score_purchase(goal, target, right).reward == 1.0
    # No options chosen: (attributes + 0 + price) / (attributes + options + 1).
    n_att, n_opt = len(goal.attributes), len(goal.options)
    expected = (n_att + 0 + 1) / (n_att + n_opt + 1)
    assert score_purchase(goal, target, {}).reward == pytest.approx(expected)
    other_category = next(p for p in env.catalog.products if p.category != goal.category)
    scored = score_purchase(goal, other_category, {})
    assert scored.r_type < 1.0 and scored.reward < expected


def test_invalid_click_leaves_the_page_unchanged(env):
    obs, info = env.reset(seed=5)
    obs, *_ = env.step(info["admissible_actions"][0])
    page_before, clicks_before = env._state.page, env.clickables()
    for bad in ["click[no such thing]", "click[buy now]", "search[again]", "hello", ""]:
        obs2, reward, terminated, truncated, info2 = env.step(bad)
        assert obs2.startswith("Invalid action!")
        assert reward == 0.0 and not terminated
        assert env._state.page == page_before and env.clickables() == clicks_before
    assert obs in obs2  # the unchanged page is shown again


def test_results_paginate_and_item_pages_work(env):
    _, info = env.reset(seed=11)
    env.step(info["admissible_actions"][0])
    first = env.clickables()
    assert "next >" in first and "< prev" not in first
    env.step("click[next >]")
    second = env.clickables()
    assert "< prev" in second and set(first[2:]).isdisjoint(second[3:])
    env.step("click[< prev]")
    assert env.clickables() == first
    asin = first[-1]
    obs, *_ = env.step(f"CLICK[{asin.upper()}]")
    assert "[buy now]" in obs and env._state.page == "item"
    obs, *_ = env.step("click[features]")
    assert obs.count("\n- ") >= 2
    env.step("click[< prev]")
    obs, *_, info = env.step("click[back to search]")
    assert info["page"] == "search" and info["admissible_actions"][0].startswith("search[")


def test_oracle_buys_a_perfect_match_on_every_one_of_200_seeds():
    env = WebShopEnv()
    scores = []
    for seed in range(200):
        env.reset(seed=seed)
        terminated = truncated = False
        reward = 0.0
        while not (terminated or truncated):
            _, reward, terminated, truncated, info = env.step(env.oracle_action())
        scores.append(reward)
        assert terminated, f"seed {seed}: the expert ran out of steps"
    assert min(scores) == 1.0
    assert info["success"] == (reward == 1.0)


def test_buying_ends_the_episode_with_the_score(env):
    env.reset(seed=2)
    while env._state.page != "item":
        env.step(env.expert_action())
    _, reward, terminated, truncated, info = env.step("click[buy now]")
    assert terminated and not truncated
    assert 0.0 <= reward <= 1.0 and info["score"] == reward
    again = env.step(env.expert_action())
    assert again[2] and again[1] == 0.0 and again[4]["admissible_actions"] == []


def test_step_limit_truncates_inside_the_env():
    env = WebShopEnv(num_products=SMALL, max_steps=3)
    env.reset(seed=0)
    results = _play(env, ["nonsense"] * 3)
    assert [r[3] for r in results] == [False, False, True]
    assert not any(r[2] for r in results)


def test_restored_env_continues_identically(env):
    rng = random.Random(4)
    env.reset(seed=9)
    for _ in range(3):
        env.step(rng.choice(env._info()["admissible_actions"]))
    snap = env.snapshot()
    catalog = env.catalog
    actions = []
    for _ in range(6):
        admissible = env._info()["admissible_actions"] or ["click[x]"]
        actions.append(rng.choice(admissible))
    first = _play(env, actions)
    env.reset(seed=123)  # wander off, then come back
    env.restore(snap)
    assert env.catalog is catalog  # shared, not copied
    assert _play(env, actions) == first
    env.restore(snap)
    assert _play(env, actions) == first  # a snapshot can be restored twice


def test_registered_and_made_through_make_env():
    env = make_env("agentrl/WebShop-v0", num_products=SMALL)
    obs, info = env.reset(seed=0)
    assert set(info) >= {"instruction", "admissible_actions", "tools"}
    assert info["tools"] == [] and info["instruction"] in obs
    with pytest.raises(EnvError):
        WebShopEnv(num_products=SMALL).step("click[x]")


def test_privileged_text_names_the_goal_product():
    from agentrl.envs.webshop import WebShopEnv

    env = WebShopEnv()
    _, info = env.reset(seed=5)
    assert env.goal.asin in info["privileged"] and env.goal.query in info["privileged"]
    assert "privileged" not in env.step(f"search[{env.goal.query}]")[4]
