"""agentrl.credit.returns: discounted returns, GAE over turns, normalisation levels."""

from __future__ import annotations

import numpy as np
import pytest

from agentrl.credit import discounted_returns, gae, normalize


def test_discounted_returns_by_hand():
    # one terminal reward: gamma**(T-1-t) -> [0.81, 0.9, 1]
    assert discounted_returns([0, 0, 1], 0.9) == pytest.approx([0.81, 0.9, 1.0])
    # G2 = 3 ; G1 = 2 + 0.5*3 = 3.5 ; G0 = 1 + 0.5*3.5 = 2.75
    assert discounted_returns([1, 2, 3], 0.5) == pytest.approx([2.75, 3.5, 3.0])
    assert discounted_returns([], 0.9) == []
    assert isinstance(discounted_returns(np.array([1.0]), 0.9), np.ndarray)


def test_gae_by_hand():
    # V = 0.5 everywhere, gamma 1, lam 0.5, terminal after turn 2:
    # delta2 = 1 + 0 - 0.5 = 0.5 ; delta1 = 0 + 0.5 - 0.5 = 0 ; delta0 = 0
    # A2 = 0.5 ; A1 = 0 + 0.5*0.5 = 0.25 ; A0 = 0 + 0.5*0.25 = 0.125
    assert gae([0, 0, 1], [0.5, 0.5, 0.5], gamma=1.0, lam=0.5) == pytest.approx([0.125, 0.25, 0.5])
    # lam = 1 is G - V: G = [1 + 0.9*1, 1] = [1.9, 1]; V = [1, 2] -> [0.9, -1]
    assert gae([1, 1], [1, 2], gamma=0.9, lam=1.0) == pytest.approx([0.9, -1.0])


def test_gae_bootstraps_a_truncated_episode():
    # delta = 0 + 0.5 * 2 - 0 = 1
    assert gae([0.0], [0.0], gamma=0.5, lam=0.9, last_value=2.0) == pytest.approx([1.0])


def test_gae_without_values_is_the_discounted_return():
    assert gae([0, 0, 1], None, gamma=0.9, lam=0.3) == pytest.approx([0.81, 0.9, 1.0])


def test_gae_rejects_bad_arguments():
    with pytest.raises(ValueError, match="values has 1 entries"):
        gae([0, 1], [0.0], gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="lam"):
        gae([0, 1], None, gamma=0.9, lam=1.5)
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns([0, 1], gamma=-0.1)


ADVS = [[1.0, 10.0], [3.0, 20.0]]


def test_normalize_turn_level_compares_same_index_turns():
    # turn 0: [1, 3] -> mean 2, population std 1 -> [-1, 1] ; turn 1: [10, 20] -> [-1, 1]
    out = normalize(ADVS, "turn")
    assert out[0] == pytest.approx([-1.0, -1.0], rel=1e-5)
    assert out[1] == pytest.approx([1.0, 1.0], rel=1e-5)


def test_normalize_batch_level():
    # all four: mean 8.5; squared deviations 56.25 + 2.25 + 30.25 + 132.25 = 221; /4 = 55.25
    # std 7.4330344 -> (x - 8.5) / 7.4330344
    s = 7.4330344
    out = normalize(ADVS, "batch")
    assert out[0] == pytest.approx([-7.5 / s, 1.5 / s], rel=1e-5)
    assert out[1] == pytest.approx([-5.5 / s, 11.5 / s], rel=1e-5)


def test_normalize_group_and_mixed():
    # groups a: [1, 2] -> mean 1.5, std 0.5 -> [-1, 1] ; b: [3] alone -> [0]
    # batch [1, 2, 3]: mean 2, std sqrt(2/3) = 0.8164966 -> [-1.2247449, 0, 1.2247449]
    advs = [[1.0, 2.0], [3.0]]
    group = normalize(advs, "group", groups=["a", "b"])
    assert group[0] == pytest.approx([-1.0, 1.0], rel=1e-5) and group[1] == [0.0]
    # mixed = mean of the two: [(-1 - 1.2247449)/2, (1 + 0)/2], [(0 + 1.2247449)/2]
    mixed = normalize(advs, "mixed", groups=["a", "b"])
    assert mixed[0] == pytest.approx([-1.1123724, 0.5], rel=1e-5)
    assert mixed[1] == pytest.approx([0.6123724], rel=1e-5)


def test_normalize_edge_cases():
    assert normalize([], "batch") == []
    assert normalize([[5.0]], "batch") == [[0.0]]
    assert normalize([[2.0, 2.0], []], "batch") == [[0.0, 0.0], []]
    with pytest.raises(ValueError, match="needs groups"):
        normalize(ADVS, "group")
    with pytest.raises(ValueError, match="level must be one of"):
        normalize(ADVS, "token")
