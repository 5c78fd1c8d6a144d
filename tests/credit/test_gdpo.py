"""agentrl.credit.gdpo: rewards normalised apart within a group, then combined."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.credit import gdpo, grpo

# Two binary rewards, four rollouts: (a, b) = (1,0), (0,1), (0,1), (0,0).
ROWS = [{"a": 1, "b": 0}, {"a": 0, "b": 1}, {"a": 0, "b": 1}, {"a": 0, "b": 0}]


def test_gdpo_keeps_apart_what_grpo_on_the_sum_merges():
    # GRPO on the sums [1, 1, 1, 0]: the first three rollouts get the same advantage.
    merged = grpo([1, 1, 1, 0])
    assert merged[0] == pytest.approx(merged[1])
    # GDPO, reward a = [1, 0, 0, 0]: mean 0.25, sample std 0.5 -> [1.5, -0.5, -0.5, -0.5]
    #       reward b = [0, 1, 1, 0]: mean 0.5, sample std 0.5773503 -> [-0.8660254, +, +, -]
    # sum: [0.6339746, 0.3660254, 0.3660254, -1.3660254]
    raw = gdpo(ROWS, batch_norm=False)
    assert raw == pytest.approx([0.6339746, 0.3660254, 0.3660254, -1.3660254], rel=1e-5)
    # batch renormalisation: mean 0, sample std sqrt((0.4019238 + 2*0.1339746 + 1.8660254)/3)
    # = 0.9194 -> [0.6895502, 0.3981124, 0.3981124, -1.4857749]
    out = gdpo(ROWS)
    assert out == pytest.approx([0.6895502, 0.3981124, 0.3981124, -1.4857749], rel=1e-5)
    assert out[0] > out[1]  # the rare reward counts for more


def test_gdpo_weights_by_name_or_column():
    # weights a: 2, b: 0 -> 2 * [1.5, -0.5, -0.5, -0.5]
    by_name = gdpo(ROWS, weights={"a": 2.0, "b": 0.0}, batch_norm=False)
    assert by_name == pytest.approx([3.0, -1.0, -1.0, -1.0], rel=1e-5)
    matrix = np.array([[r["a"], r["b"]] for r in ROWS], dtype=float)
    by_column = gdpo(matrix, weights=[2.0, 0.0], batch_norm=False)
    assert isinstance(by_column, np.ndarray)
    assert by_column.tolist() == pytest.approx(by_name)
    assert isinstance(gdpo(torch.tensor(matrix)), torch.Tensor)


def test_gdpo_normalises_each_group_on_its_own():
    # group x: a = [1, 0] -> +-0.7071068 ; group y: a = [5, 5] -> 0 (constant in its group)
    out = gdpo([[1.0], [0.0], [5.0], [5.0]], groups=["x", "x", "y", "y"], batch_norm=False)
    assert out == pytest.approx([0.7071068, -0.7071068, 0.0, 0.0], rel=1e-5)


def test_gdpo_edge_cases_and_errors():
    assert gdpo([]) == []
    assert gdpo([{"a": 3.0}]) == [0.0]
    with pytest.raises(ValueError, match=r"rewards\[1\] must have the keys"):
        gdpo([{"a": 1}, {"b": 1}])
    with pytest.raises(ValueError, match="weights keys"):
        gdpo(ROWS, weights={"a": 1.0})
    with pytest.raises(ValueError, match="groups has 1 ids"):
        gdpo(ROWS, groups=["x"])
    with pytest.raises(ValueError, match="2-D"):
        gdpo([1.0, 2.0])


def test_gdpo_weights_by_position_need_one_key_order():
    # Two rows, keys in different orders. By position, [2, 0] weighted "a" when row 0 came
    # first and "b" when row 1 did: it is refused, naming both orders.
    rows = [{"a": 1.0, "b": 0.0}, {"b": 1.0, "a": 0.0}]
    for batch in (rows, rows[::-1]):
        with pytest.raises(ValueError, match=r"rewards\[1\] has \[.*\]; give weights by name"):
            gdpo(batch, weights=[2.0, 0.0], batch_norm=False)
    # By name the order does not matter. Reward a = [1, 0]: mean 0.5, sample std 0.7071068
    # -> [0.7071068, -0.7071068]; times 2 (b weighs 0) -> [1.4142136, -1.4142136].
    by_name = {"a": 2.0, "b": 0.0}
    assert gdpo(rows, weights=by_name, batch_norm=False) == pytest.approx([1.4142136, -1.4142136], rel=1e-5)
    assert gdpo(rows[::-1], weights=by_name, batch_norm=False) == pytest.approx([-1.4142136, 1.4142136], rel=1e-5)
    # rows in one order: by position is by that order
    same = [{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0}]
    assert gdpo(same, weights=[2.0, 0.0], batch_norm=False) == pytest.approx([1.4142136, -1.4142136], rel=1e-5)
