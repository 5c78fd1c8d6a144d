"""agentrl.credit.group: GRPO, Dr. GRPO, RLOO, MC-GRPO on hand-computed groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.credit import dr_grpo, grpo, mc_grpo, mc_grpo_pivot, rloo

ALL = [grpo, dr_grpo, rloo, mc_grpo]


def test_grpo_uses_the_sample_std():
    # r = [1, 0, 0, 1]: mean 0.5; sample var = 4 * 0.25 / (4 - 1) = 1/3, std = 0.5773503
    # A = +-0.5 / 0.5773503 = +-0.8660254 (eps = 1e-6 moves the 7th digit)
    assert grpo([1, 0, 0, 1]) == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], rel=1e-5)
    # r = [0, 1]: sample std sqrt(0.5) = 0.7071068 -> +-0.7071068 (the population std would give +-1)
    assert grpo([0, 1]) == pytest.approx([-0.7071068, 0.7071068], rel=1e-5)


def test_dr_grpo_only_centres():
    # mean 0.5 -> r - 0.5; mean 2 -> [1, -1]
    assert dr_grpo([1, 0, 0, 1]) == [0.5, -0.5, -0.5, 0.5]
    assert dr_grpo([3, 1]) == [1.0, -1.0]


def test_rloo_baseline_is_the_mean_of_the_others():
    # r = [1, 0, 0, 1]: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    assert rloo([1, 0, 0, 1]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # r = [1, 2, 6]: 1 - 8/2 = -3 ; 2 - 7/2 = -1.5 ; 6 - 3/2 = 4.5 (= 3/2 * (r - mean 3))
    assert rloo([1, 2, 6]) == pytest.approx([-3.0, -1.5, 4.5])


def test_mc_grpo_centres_on_the_median_and_zeroes_the_pivot():
    r = [1, 3, 4, 10, 2]
    # sorted: 1, 2, [3], 4, 10 -> median 3, held by index 1 (the pivot)
    assert mc_grpo_pivot(r) == 1
    # unscaled: r - 3 = [-2, 0, 1, 7, -1]; reward 4 is above the median and stays positive,
    # while the outlier-pulled mean (4) would have given it 0
    assert mc_grpo(r, scale="none") == [-2.0, 0.0, 1.0, 7.0, -1.0]
    # sample std: mean 4, squared deviations 9+1+0+36+4 = 50, /4 = 12.5, std 3.5355339
    expected = [-2 / 3.5355339, 0.0, 1 / 3.5355339, 7 / 3.5355339, -1 / 3.5355339]
    assert mc_grpo(r) == pytest.approx(expected, rel=1e-5)


def test_mc_grpo_even_group_has_no_pivot():
    # median of [0, 1, 2, 3] = 1.5
    assert mc_grpo_pivot([0, 1, 2, 3]) is None
    assert mc_grpo([0, 1, 2, 3], scale="none") == [-1.5, -0.5, 0.5, 1.5]


def test_mc_grpo_ties_pick_exactly_one_pivot():
    # stable sort of [1, 1, 1] keeps the order; the middle position is index 1
    assert mc_grpo_pivot([1, 1, 1]) == 1
    # [0, 1, 1, 0, 1]: sorted indices 0, 3, 1, 2, 4 -> position 2 is index 1
    assert mc_grpo_pivot([0, 1, 1, 0, 1]) == 1


@pytest.mark.parametrize("fn", ALL)
def test_degenerate_groups_give_zeros_not_nan(fn):
    assert fn([]) == []
    assert fn([0.7]) == [0.0]
    assert fn([2.0, 2.0, 2.0]) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("fn", ALL)
def test_output_container_follows_the_input(fn):
    out = fn(np.array([0.0, 1.0, 3.0]))
    assert isinstance(out, np.ndarray) and out.shape == (3,)
    t = fn(torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float64
    assert t.tolist() == pytest.approx(out.tolist())
    assert fn(torch.tensor([0, 1, 3])).dtype == torch.float32  # integer rewards -> float


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        grpo([[1.0, 2.0]])
    with pytest.raises(ValueError, match="rewards must be finite"):
        rloo([1.0, float("nan")])
    with pytest.raises(ValueError, match="scale"):
        mc_grpo([1.0, 2.0, 3.0], scale="mad")
