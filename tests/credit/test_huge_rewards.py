"""agentrl.credit with rewards near float64's limit (1.8e308).

A group's sum, ``r - mean`` or the squares in its std overflowed to inf, and the
advantages came out inf or NaN. Normalised advantages do not depend on the rewards'
scale, so they are computed on the rewards scaled by a power of two (exactly); where
the advantage itself is out of float64's range (no std to divide by), a clear error
names the rewards. Every expected value here is computed by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentrl.credit import (
    discounted_returns,
    dr_grpo,
    episode_outcome,
    gdpo,
    gigpo_advantages,
    grpo,
    mc_grpo,
    normalize,
    rloo,
    tree_advantages,
)
from agentrl.credit.group import _center_scale

from .conftest import build_tree

X = 1.6e308
HUGE = [X, X, -X]  # sum 1.6e308 after 3.2e308 on the way; r - mean = -2.13e308 for the last


def test_grpo_on_huge_rewards():
    # x, x, -x: mean x/3, deviations (2/3, 2/3, -4/3) x, sample std sqrt((4 + 4 + 16)/9 / 2) x
    # = 1.1547005 x, so A = (0.5773503, 0.5773503, -1.1547005), whatever x is
    assert grpo(HUGE) == pytest.approx([0.5773503, 0.5773503, -1.1547005])
    assert grpo(np.array(HUGE)) == pytest.approx(grpo([1.0, 1.0, -1.0]))
    # the same for batch whitening (population std sqrt(24/9/3) x = 0.9428090 x)
    assert normalize([HUGE], "batch") == [pytest.approx([0.7071068, 0.7071068, -1.4142136])]
    # and GDPO's per-reward normalisation
    assert gdpo([[v] for v in HUGE], batch_norm=False) == pytest.approx([0.5773503, 0.5773503, -1.1547005])


def test_mc_grpo_on_huge_rewards():
    # median x; d = (0, 0, -2x); A = d / 1.1547005 x = (0, 0, -1.7320508); the pivot (index 0) is 0
    assert mc_grpo(HUGE) == pytest.approx([0.0, 0.0, -1.7320508])


def test_unnormalised_advantages_that_fit_are_computed():
    # 1.5e308 + 1.5e308 + 1.0e308 overflows, the advantages do not:
    # Dr. GRPO: mean 4/3 e308 -> (1/6, 1/6, -1/3) e308
    r = [1.5e308, 1.5e308, 1.0e308]
    assert dr_grpo(r) == pytest.approx([1.5e308 / 9, 1.5e308 / 9, -1e308 / 3])
    # RLOO: 1.5 - (1.5 + 1.0) / 2 = 0.25 and 1.0 - 1.5 = -0.5 (e308)
    assert rloo(r) == pytest.approx([0.25e308, 0.25e308, -0.5e308])


def test_unnormalised_advantages_out_of_range_are_refused_naming_the_rewards():
    # Dr. GRPO on x, x, -x: -4/3 x = -2.13e308 is past float64's 1.8e308
    with pytest.raises(ValueError, match=r"1\.6e\+308.*overflow"):
        dr_grpo(HUGE)
    with pytest.raises(ValueError, match="overflow"):
        rloo(HUGE)  # 1.5 * -4/3 x
    with pytest.raises(ValueError, match="overflow"):
        _center_scale(np.array(HUGE), "none")


def test_gigpo_on_huge_rewards():
    # Two 2-step episodes, one state per step: returns (gamma 1) of 2e308 would overflow.
    # Totals (2e308, 0) -> A_E = +-0.7071068; step 0 returns (2e308, 0) -> +-0.7071068;
    # step 1 returns (1e308, 0) -> +-0.7071068; A = A_E + A_S = +-1.4142136 on both steps.
    out = gigpo_advantages([[1e308, 1e308], [0.0, 0.0]], [["s", "t"], ["s", "t"]], gamma=1.0)
    assert out == [pytest.approx([1.4142136, 1.4142136]), pytest.approx([-1.4142136, -1.4142136])]
    # scale none: A_E = +-1e308 and A_S(step 0) = +-1e308 sum to 2e308: out of range
    with pytest.raises(ValueError, match="overflow"):
        gigpo_advantages([[1e308, 1e308], [0.0, 0.0]], [["s", "t"], ["s", "t"]], gamma=1.0, scale="none")


def test_a_return_that_overflows_is_refused_naming_the_rewards():
    with pytest.raises(ValueError, match=r"1e\+308.*overflow"):
        discounted_returns([1e308, 1e308])
    (episode,) = build_tree([(None, 1e308, {}), (0, 1e308, {"terminated": True})]).episodes()
    with pytest.raises(ValueError, match=r"1e\+308.*overflow"):
        episode_outcome(episode)


def test_tree_advantages_out_of_range_are_refused():
    # outcomes +-1.6e308: V(super-root) = 0, A(n) = 2 (V(n) - 0) = +-3.2e308, out of range
    tree = build_tree([(None, X, {"terminated": True}), (None, -X, {"terminated": True})])
    with pytest.raises(ValueError, match="overflow"):
        tree_advantages(tree)


def test_scaling_changes_nothing_on_ordinary_rewards():
    # a power-of-two scaling is exact: the same bits as (r - mean) / (std + eps)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = rng.normal(size=int(rng.integers(2, 12))) * 10.0 ** rng.integers(-3, 4)
        d = a - a.mean()
        assert np.array_equal(_center_scale(a, "std", 1e-6), d / (a.std(ddof=1) + 1e-6))
        assert np.array_equal(_center_scale(a, "none"), d)


def test_gdpo_with_huge_weights():
    # reward a = (1, 0, 0): mean 1/3, sample std 0.5773503 -> (1.1547005, -0.5773503, -0.5773503);
    # times 1.7e308 the first is 1.96e308, out of range; renormalised over the batch it is not:
    # (1.1547005, -0.5773503, -0.5773503) again (already mean 0, sample std 1)
    rows = [[1.0], [0.0], [0.0]]
    assert gdpo(rows, weights=[1.7e308]) == pytest.approx([1.1547005, -0.5773503, -0.5773503])
    with pytest.raises(ValueError, match=r"weights \[1\.7e\+308\] overflow"):
        gdpo(rows, weights=[1.7e308], batch_norm=False)
