"""agentrl.rollout.allocators under hostile options: each test pins a defect a hostile review found."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.rollout.allocators import entropy_branch_scores, options_for
from agentrl.types import RolloutTree
from tests.rollout.allocators.sim import linear

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



def test_the_aepo_penalty_never_raises_a_score():
    # threshold -1 (unbounded: "branch unless entropy fell by 1 nat or more"), penalty 0.5.
    # Entropies 1.0, 1.0, 0.0: turn 1 rose by 0 (> -1, kept), turn 2 by -1 (not > -1). Turn 2
    # follows a kept turn, so it is penalised; -1 * 0.5 = -0.5 > -1 made the penalty *add* it
    # as a branch point. Lowered by the same share instead: -1 - 0.5 * |-1| = -1.5, left out
    tree = RolloutTree()
    ids = linear(tree, [{"entropies": [1.0]}, {"entropies": [1.0]}, {"entropies": [0.0], "terminated": True}])
    assert entropy_branch_scores(tree, threshold=-1.0, penalty=0.5) == {ids[1]: 0.0}
    # a positive score is scaled as before: rises 0.8 then 0.8 over threshold 0.5 -> 0.8, 0.4 (left out)
    tree = RolloutTree()
    ids = linear(tree, [{"entropies": [0.2]}, {"entropies": [1.0]}, {"entropies": [1.0], "terminated": True}])
    assert entropy_branch_scores(tree, threshold=0.5, penalty=0.5) == pytest.approx({ids[1]: 0.8})
