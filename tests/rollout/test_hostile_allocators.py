"""agentrl.rollout.allocators under hostile options: each test pins a defect a hostile review found."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.rollout.allocators import options_for

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("name, key, value", [
    ("independent", "est_leaf_cost", INF),  # remaining // inf = 0 leaves: no episode at all
    ("pilot_commit", "est_leaf_cost", INF),
    ("entropy_branch", "threshold", NAN),   # score > nan is never true: no branch, ever
    ("entropy_branch", "threshold", INF),
    ("segment_tree", "est_leaf_cost", INF),
])
def test_a_non_finite_allocator_option_is_refused_naming_it(name, key, value):
    with pytest.raises(ConfigError, match=f"option '{key}': Input should be a finite number"):
        options_for(name, **{key: value})


def test_a_non_finite_allocator_option_fails_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"rollout\.allocator\.threshold: Input should be a finite number"):
        load_config(None, ["rollout.allocator={name: entropy_branch, threshold: .nan}"])

