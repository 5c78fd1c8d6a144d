"""agentrl.credit under hostile inputs: equal groups, eps = 0, odd state keys, non-finite values.

Each test pins a defect a hostile review found, with a hand-computed expected value.
"""

from __future__ import annotations

import pytest

from agentrl.credit import (
    assign,
    credit_options,
    dr_grpo,
    episode_state_keys,
    gae,
    gdpo,
    gigpo_advantages,
    gigpo_episode_advantages,
    grpo,
    mc_grpo,
    normalize,
    rloo,
    tree_advantages,
)
from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config
from agentrl.types import EpisodeGroup

from .conftest import build_tree

# -- all-equal groups: exactly 0, whatever eps ------------------------------------------------


@pytest.mark.parametrize("r", [0.7, 0.1, 0.3, 1 / 3])
@pytest.mark.parametrize("n", [3, 5, 6, 7, 10])
def test_an_all_equal_group_gets_exact_zeros(r, n):
    # every episode scored r: no episode is better than another, A_i = 0 exactly.
    # 0.7 * 3 sums to 2.0999999999999996, so GRPO gave 1.1e-10, not 0: the trainer's
    # skip_zero_advantage (a == 0.0) kept such groups, and no_signal saw a signal
    group = [r] * n
    for fn in (grpo, dr_grpo, rloo, mc_grpo):
        assert fn(group) == [0.0] * n, fn.__name__


@pytest.mark.parametrize("n", [2, 3, 5])
def test_eps_zero_gives_an_equal_group_zeros_not_nan(n):
    # eps = 0 is a valid option (ge=0): std = 0 made 0/0 = NaN, and float noise in the mean of
    # [0.1] * 3 made (r - mean) / std = -0.816 for every episode
    assert grpo([1.0] * n, eps=0.0) == [0.0] * n
    assert grpo([0.1] * 3, eps=0.0) == [0.0, 0.0, 0.0]
    assert mc_grpo([2.0] * n, eps=0.0) == [0.0] * n
    assert gdpo([[1.0, 0.3]] * n, eps=0.0) == [0.0] * n
    assert normalize([[0.7], [0.7], [0.7]], "batch", eps=0.0) == [[0.0], [0.0], [0.0]]
    # one anchor group {a}: two steps with returns 1, 1 -> A_E = 0 and A_S = 0
    assert gigpo_advantages([[1.0], [1.0]], [["a"], ["a"]], eps=0.0) == [[0.0], [0.0]]


def test_eps_zero_still_normalises_a_group_that_differs():
    # r = [0, 1]: sample std sqrt(0.5); with eps = 0 A = +-0.5 / 0.7071068 = +-0.7071068
    assert grpo([0.0, 1.0], eps=0.0) == pytest.approx([-0.7071068, 0.7071068])
    # whitening [1, 3] with the population std 1: [-1, 1]
    assert normalize([[1.0], [3.0]], "batch", eps=0.0) == [[-1.0], [1.0]]


def test_assign_gives_every_token_of_an_equal_group_exact_zero():
    # three episodes, each one turn with reward 0.7: every action token gets 0.0 exactly
    tree = build_tree([(None, 0.7, {"terminated": True})] * 3)
    for method in ("grpo", "dr_grpo", "rloo", "gigpo"):
        advs = [a for _, token_advs in assign([tree], method) for a in token_advs]
        assert advs == [0.0] * 15, method


# -- GiGPO state keys ------------------------------------------------------------------------


def test_an_integer_state_key_zero_names_an_anchor_state():
    # an env whose states are numbered (room 0, 1, ...) reports info["state_key"] = 0; it was
    # read as "no key" (falsy), so the two turns taken in room 0 were keyed by their differing
    # observations and shared no anchor group
    tree = build_tree([
        (None, 0.0, {"info": {"state_key": 0}, "observation": "Room 0. Nothing happens."}),
        (0, 1.0, {"terminated": True}),
        (None, 0.0, {"info": {"state_key": 0}, "observation": "Room 0."}),
        (2, 0.0, {"terminated": True}),
    ])
    keys = [episode_state_keys(e, tree) for e in EpisodeGroup.of(tree).episodes]
    assert keys[0][1] == keys[1][1] == "0"
    # scale none, gamma 0.95, omega 1. Totals 1, 0 -> A_E = +-0.5. Opening state: returns
    # 0.95 and 0 -> A_S = +-0.475. Room 0: returns 1 and 0 -> A_S = +-0.5
    advs = gigpo_episode_advantages(EpisodeGroup.of(tree).episodes, tree, scale="none")
    assert advs[0] == pytest.approx([0.975, 1.0])
    assert advs[1] == pytest.approx([-0.975, -1.0])


def test_an_opening_state_key_zero_is_the_opening_anchor():
    # the engine stores a reset key 0 in tree.meta (it tests `is not None`); GiGPO ignored it, so
    # a turn back in the opening state did not join the first turn's anchor group
    tree = build_tree([(None, 0.0, {"info": {"state_key": 0}, "observation": "You look around."}),
                       (0, 1.0, {"terminated": True})], meta={"state_key": 0})
    (episode,) = EpisodeGroup.of(tree).episodes
    assert episode_state_keys(episode, tree) == ["0", "0"]


# -- non-finite values fail loudly -----------------------------------------------------------


def test_tree_refuses_a_non_finite_outcome_as_the_group_methods_do():
    # grpo, gigpo, returns and gdpo raise on a NaN reward; tree averaged it into every value
    # above the leaf and returned NaN advantages for the whole tree, silently
    tree = build_tree([(None, 1.0, {"terminated": True}), (None, float("nan"), {"terminated": True})])
    with pytest.raises(ValueError, match="leaf 1"):
        tree_advantages(tree)
    with pytest.raises(ValueError, match="finite"):
        assign([tree], "tree")
    ok = build_tree([(None, 1.0, {"terminated": True}), (None, 0.0, {"terminated": True})])
    with pytest.raises(ValueError, match="finite"):
        tree_advantages(ok, outcome=lambda e: float("inf") if e.total_reward else 0.0)
    # the same tree with finite outcomes: V(super-root) = 0.5, A(n) = 2 (V(n) - 0.5) / sqrt(1)
    assert tree_advantages(ok) == {0: 1.0, 1: -1.0}


def test_gae_refuses_a_non_finite_bootstrap_as_it_refuses_non_finite_values():
    # values must be finite (ValueError), but V of the state after a cut episode went straight
    # into delta_T: a value head's NaN made every turn's advantage NaN, silently
    with pytest.raises(ValueError, match="last_value"):
        gae([1.0], [0.5], last_value=float("nan"))
    truncated = build_tree([(None, 1.0, {"truncated": True})])
    with pytest.raises(ValueError, match="last_value"):
        assign([truncated], "gae", value_fn=lambda e: [0.5, float("inf")], level=None)
    # finite: delta_0 = r + gamma * V(s_1) - V(s_0) = 1 + 2 - 0.5 = 2.5
    assert gae([1.0], [0.5], last_value=2.0) == [2.5]


@pytest.mark.parametrize("method, key, value", [
    ("gigpo", "omega", float("inf")),       # inf * A_S = inf * 0 = NaN on every singleton step
    ("grpo", "eps", float("inf")),          # (r - mean) / inf: every advantage 0, silently
    ("tree", "global_weight", float("nan")),
    ("tree", "max_scale", float("inf")),
    ("gdpo", "weights", [1.0, float("nan")]),
    ("gdpo", "weights", {"a": float("-inf")}),
])
def test_a_non_finite_credit_option_is_refused_naming_it(method, key, value):
    with pytest.raises(ValueError, match=f"option '{key}"):
        credit_options(method, **{key: value})


def test_a_non_finite_credit_option_fails_when_the_config_loads():
    # it loaded, and the run trained on NaN advantages (omega: .inf) from its first step
    with pytest.raises(ConfigError, match=r"train\.credit\.omega"):
        load_train_config(None, ["train.credit={name: gigpo, omega: .inf}"])

