"""agentrl.credit.tree: node values, TreeRL advantages, sibling scaling, partial nodes."""

from __future__ import annotations

import math

import pytest

from agentrl.credit import node_values, tree_advantages
from agentrl.credit.tree import SUPER_ROOT, leaf_outcome, turn_advantages

#        r0 (0)
#       /      \
#     a (0)    b (0)
#     /   \       \
#  a1 (1) a2 (0)  b1 (1)
SPEC = [
    (None, 0.0, {}),                   # 0 r0
    (0, 0.0, {}),                      # 1 a
    (0, 0.0, {}),                      # 2 b
    (1, 1.0, {"terminated": True}),    # 3 a1
    (1, 0.0, {"truncated": True}),     # 4 a2
    (2, 1.0, {"terminated": True}),    # 5 b1
]


def test_node_values_are_leaf_means(make_tree):
    v = node_values(make_tree(SPEC))
    # leaves 1, 0, 1 ; a = (1+0)/2 ; b = 1 ; r0 = 2/3 ; super-root = mean of all leaves = 2/3
    assert v == pytest.approx({0: 2 / 3, 1: 0.5, 2: 1.0, 3: 1.0, 4: 0.0, 5: 1.0, SUPER_ROOT: 2 / 3})


def test_tree_advantages_global_plus_local(make_tree):
    adv = tree_advantages(make_tree(SPEC), leaf_norm="none")
    # A = (V - V_root) + (V - V_parent), V_root = 2/3:
    # r0: 0 + 0 ; a: -1/6 - 1/6 ; b: 1/3 + 1/3 ; a1: 1/3 + 1/2 ; a2: -2/3 - 1/2 ; b1: 1/3 + 0
    assert adv == pytest.approx({0: 0.0, 1: -1 / 3, 2: 2 / 3, 3: 5 / 6, 4: -7 / 6, 5: 1 / 3})


def test_tree_advantages_weights_and_sqrt_leaf_norm(make_tree):
    tree = make_tree(SPEC)
    # TreeRL divides by sqrt(#leaves under the node): a has 2 leaves -> -1/3 / sqrt 2
    adv = tree_advantages(tree)
    assert adv[1] == pytest.approx(-1 / 3 / math.sqrt(2))
    assert adv[3] == pytest.approx(5 / 6)
    # local only: a1 = 1 - 0.5 ; global only: a1 = 1 - 2/3
    assert tree_advantages(tree, global_weight=0, leaf_norm="none")[3] == pytest.approx(0.5)
    assert tree_advantages(tree, local_weight=0, leaf_norm="none")[3] == pytest.approx(1 / 3)


def test_contrastive_scaling_keeps_signs(make_tree):
    tree = make_tree(SPEC)
    plain = tree_advantages(tree, leaf_norm="none")
    adv = tree_advantages(tree, leaf_norm="none", contrastive=True)
    # siblings {a, b}: values 0.5, 1 -> population std 0.25 -> factor 1/0.25 = 4
    assert adv[1] == pytest.approx(-4 / 3, rel=1e-5) and adv[2] == pytest.approx(8 / 3, rel=1e-5)
    # siblings {a1, a2}: values 1, 0 -> std 0.5 -> factor 2
    assert adv[3] == pytest.approx(5 / 3, rel=1e-5) and adv[4] == pytest.approx(-7 / 3, rel=1e-5)
    # single children (b1) and the single root are left alone
    assert adv[5] == pytest.approx(plain[5]) and adv[0] == plain[0]
    assert all((adv[i] > 0) == (plain[i] > 0) for i in plain if plain[i] != 0)
    # the factor is clamped to max_scale
    assert tree_advantages(tree, leaf_norm="none", contrastive=True, max_scale=3)[1] == pytest.approx(-1.0)


def test_several_roots_hang_under_a_virtual_super_root(make_tree):
    # roots R0 (leaf, reward 1) and R1 (0) with leaves c1 (0), c2 (1): super-root = 2/3
    tree = make_tree([
        (None, 1.0, {"terminated": True}),
        (None, 0.0, {}),
        (1, 0.0, {"truncated": True}),
        (1, 1.0, {"terminated": True}),
    ])
    v = node_values(tree)
    assert v[SUPER_ROOT] == pytest.approx(2 / 3) and v[1] == pytest.approx(0.5)
    adv = tree_advantages(tree, leaf_norm="none")
    # R0: (1 - 2/3) * 2 ; R1: (0.5 - 2/3) * 2 ; c1: -2/3 - 1/2 ; c2: 1/3 + 1/2
    assert adv == pytest.approx({0: 2 / 3, 1: -1 / 3, 2: -7 / 6, 3: 5 / 6})


def test_partial_node_has_a_value_and_its_tokens_join_the_childs_turn(make_tree):
    # p is a segment fork inside turn 0: children x (reward 1) and y (reward 0) continue it
    tree = make_tree([
        (None, 0.0, {"partial": True}),
        (0, 1.0, {"terminated": True}),
        (0, 0.0, {"truncated": True}),
    ])
    v = node_values(tree)
    assert v[0] == pytest.approx(0.5)
    adv = tree_advantages(tree, leaf_norm="none")
    # p: 0 ; x: (1 - 0.5) + (1 - 0.5) = 1 ; y: -1
    assert adv == pytest.approx({0: 0.0, 1: 1.0, 2: -1.0})
    ep_x = next(tree.episodes())
    assert ep_x.num_turns == 1 and ep_x.turn_spans == [(3, 7)]  # p's 2 tokens + x's 2 tokens
    assert turn_advantages(ep_x, adv) == [1.0]


def test_leaf_outcomes_and_exclusion(make_tree):
    tree = make_tree([
        (None, 0.0, {}),
        (0, 0.5, {"terminated": True, "info": {"success": True}}),
        (0, 0.5, {"terminated": True}),
        (0, 0.0, {"truncated": True, "error": "sandbox died"}),
    ])
    leaves = {n.id: n for n in tree.leaves()}
    assert leaf_outcome(tree, leaves[1], "success") == 1.0  # the env said so
    assert leaf_outcome(tree, leaves[2], "success") == 0.0  # partial credit: 0.5 < SUCCESS_REWARD
    assert leaf_outcome(tree, leaves[3], "success") == 0.0
    assert leaf_outcome(tree, leaves[1], lambda ep: 7 * ep.num_turns) == 14.0
    # the failed leaf 3 left out: the root's value is (0.5 + 0.5) / 2, and leaf 3 has none
    v = node_values(tree, exclude={3})
    assert v[0] == pytest.approx(0.5) and 3 not in v
    assert 3 not in tree_advantages(tree, exclude={3})
    with pytest.raises(ValueError, match="outcome must be"):
        leaf_outcome(tree, leaves[1], "bogus")


def test_tree_methods_take_the_outcome_by_the_name_assign_uses(make_tree):
    tree = make_tree([
        (None, 0.0, {}),
        (0, 0.5, {"terminated": True, "info": {"success": False}}),  # rewarded, but the env says no
        (0, 0.0, {"terminated": True, "info": {"success": True}}),
    ])
    # success: V(1) = 0, V(2) = 1, V(0) = V(super-root) = 0.5; A(n) = 2 (V(n) - 0.5) with no norm
    adv = tree_advantages(tree, outcome="success", leaf_norm="none")
    assert adv == pytest.approx({0: 0.0, 1: -1.0, 2: 1.0})
    assert node_values(tree, outcome="return") == pytest.approx({0: 0.25, 1: 0.5, 2: 0.0, SUPER_ROOT: 0.25})


def test_empty_tree_and_bad_options(make_tree):
    assert tree_advantages(make_tree([])) == {}
    assert node_values(make_tree([])) == {}
    with pytest.raises(ValueError, match="leaf_norm"):
        tree_advantages(make_tree(SPEC), leaf_norm="log")
