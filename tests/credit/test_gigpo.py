"""agentrl.credit.gigpo: anchor groups and GiGPO advantages on a hand-built group."""

from __future__ import annotations

import pytest

from agentrl.credit import (
    anchor_groups,
    episode_state_keys,
    gigpo_advantages,
    gigpo_episode_advantages,
    grpo,
)
from agentrl.credit.gigpo import normalize_observation, text_key

# Three episodes of one task. All start in s0; episodes 0 and 1 both reach state "a"
# (a shared anchor) and then part ways; episode 2 goes to "d" and succeeds at once.
REWARDS = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0]]
KEYS = [["s0", "a", "b"], ["s0", "a", "c"], ["s0", "d"]]


def test_anchor_groups_collect_steps_by_state():
    groups = anchor_groups(REWARDS, KEYS)
    assert groups == {
        "s0": [(0, 0), (1, 0), (2, 0)],
        "a": [(0, 1), (1, 1)],
        "b": [(0, 2)],
        "c": [(1, 2)],
        "d": [(2, 1)],
    }


def test_gigpo_step_advantages_differ_from_grpo_where_a_state_is_shared():
    # Episode level (GRPO on totals [1, 0, 1]): mean 2/3, sample var (1/9 + 4/9 + 1/9)/2 = 1/3,
    # std 0.5773503 -> A_E = [0.5773503, -1.1547005, 0.5773503].
    a_e = [0.5773503, -1.1547005, 0.5773503]
    assert grpo([1, 0, 1]) == pytest.approx(a_e, rel=1e-5)
    # Step returns, gamma 0.95: ep0 [0.9025, 0.95, 1], ep1 [0, 0, 0], ep2 [0.95, 1].
    # Group s0: [0.9025, 0, 0.95], mean 0.6175, deviations [0.285, -0.6175, 0.3325],
    #   sample std sqrt((0.081225 + 0.38130625 + 0.11055625)/2) = 0.5352978
    #   -> A_S = [0.5324129, -1.1535613, 0.6211484]
    # Group a: [0.95, 0] -> +-0.475 / 0.6717514 = +-0.7071068
    # Groups b, c, d hold one step each -> A_S = 0.
    s0 = [0.5324129, -1.1535613, 0.6211484]
    a = 0.7071068
    expected = [
        [a_e[0] + s0[0], a_e[0] + a, a_e[0]],
        [a_e[1] + s0[1], a_e[1] - a, a_e[1]],
        [a_e[2] + s0[2], a_e[2]],
    ]
    out = gigpo_advantages(REWARDS, KEYS, gamma=0.95, omega=1.0)
    for got, want in zip(out, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    # GRPO gives every step of an episode the same number; GiGPO separates the step
    # taken in the shared state "a" (ep0 +0.707, ep1 -0.707) from the others.
    assert out[0][1] != pytest.approx(out[0][2])
    assert out[0][1] - out[0][2] == pytest.approx(a, rel=1e-5)


def test_gigpo_without_std_and_with_omega():
    # scale "none": A_E = totals - mean = [1/3, -2/3, 1/3]; s0 deviations [0.285, -0.6175, 0.3325];
    # "a": +-0.475. omega 0.5 halves the step terms.
    out = gigpo_advantages(REWARDS, KEYS, gamma=0.95, omega=0.5, scale="none")
    assert out[0] == pytest.approx([1 / 3 + 0.1425, 1 / 3 + 0.2375, 1 / 3])
    assert out[1] == pytest.approx([-2 / 3 - 0.30875, -2 / 3 - 0.2375, -2 / 3])
    assert out[2] == pytest.approx([1 / 3 + 0.16625, 1 / 3])


def test_gigpo_with_no_shared_state_is_episode_grpo():
    keys = [[f"{i}-{t}" for t in range(len(r))] for i, r in enumerate(REWARDS)]
    out = gigpo_advantages(REWARDS, keys)
    for row, a in zip(out, grpo([1, 0, 1]), strict=True):
        assert row == pytest.approx([a] * len(row))


def test_gigpo_edge_cases():
    assert gigpo_advantages([], []) == []
    assert gigpo_advantages([[0.0, 1.0]], [["x", "y"]]) == [[0.0, 0.0]]  # a group of one
    assert gigpo_advantages([[1.0], [1.0]], [["x"], ["x"]]) == [[0.0], [0.0]]  # all equal
    with pytest.raises(ValueError, match=r"state_keys\[0\] has 1 keys for 2 steps"):
        gigpo_advantages([[0.0, 1.0]], [["x"]])


def test_similarity_merges_near_identical_observations():
    # ratio("you are in the kitchen.", "you are in the kitchen!") = 44/46 = 0.9565
    keys = [["you are in the kitchen."], ["you are in the kitchen!"], ["a garden"]]
    exact = anchor_groups([[0], [0], [0]], keys)
    assert len(exact) == 3
    merged = anchor_groups([[0], [0], [0]], keys, similarity=0.95)
    assert merged == {"you are in the kitchen.": [(0, 0), (1, 0)], "a garden": [(2, 0)]}
    assert len(anchor_groups([[0], [0], [0]], keys, similarity=0.99)) == 3


def test_normalised_observation_keys():
    assert normalize_observation("  You SEE\n a  Mug ") == "you see a mug"
    assert text_key("You see a mug") == text_key("you  see a\tmug")
    assert text_key("you see a mug") != text_key("you see a cup")


def test_episode_state_keys_name_the_state_each_action_was_taken_in(make_tree):
    # root (turn 0) -> child x (env key "k1") -> leaf; and root -> child y (no env key)
    tree = make_tree([
        (None, 0.0, {"observation": "Start room", "info": {"state_key": "k0"}}),
        (0, 0.0, {"observation": "Hall", "info": {"state_key": "k1"}}),
        (1, 1.0, {"terminated": True}),
        (0, 0.0, {"observation": "A  Cellar"}),
        (3, 0.0, {"truncated": True}),
    ])
    ep_x, ep_y = tree.episodes()
    opening = episode_state_keys(ep_x, tree)[0]
    assert opening.startswith("ctx:")  # a hash of the root's opening prompt tokens
    assert episode_state_keys(ep_x, tree) == [opening, "k0", "k1"]
    assert episode_state_keys(ep_y, tree) == [opening, "k0", "obs:" + text_key("a cellar")]
    assert episode_state_keys(ep_y, tree, hashed=False)[2] == "a cellar"
    tree.meta["state_key"] = "reset-key"  # the engine stored the reset info's key
    assert episode_state_keys(ep_x, tree)[0] == "reset-key"


def test_gigpo_on_episodes_of_a_tree(make_tree):
    # Two episodes share the root (state at turn 0) and the state "k0" at turn 1.
    tree = make_tree([
        (None, 0.0, {"info": {"state_key": "k0"}}),
        (0, 1.0, {"terminated": True}),
        (0, 0.0, {"truncated": True}),
    ])
    episodes = list(tree.episodes())
    out = gigpo_episode_advantages(episodes, tree, gamma=0.5, scale="none")
    # totals [1, 0] -> A_E = [0.5, -0.5]. Turn 0 is one shared node: returns [0.5, 0] -> +-0.25.
    # Turn 1 (state k0): returns [1, 0] -> +-0.5.
    assert out == [pytest.approx([0.75, 1.0]), pytest.approx([-0.75, -1.0])]


def test_anchor_group_stats_count_recurring_states(make_tree):
    """Three episodes: all open in one state; two reach state "a" at turn 1 and one "b";
    an errored one counts nowhere. By hand: 3 first steps in one group of 3; later
    steps "a", "a" (a group of 2) and "b" (alone); so 5 of 6 steps, 2 of 3 later ones."""
    from agentrl.credit import anchor_group_stats

    tree = make_tree([
        (None, 0.0, {"info": {"state_key": "a"}}),  # 0: turn 0 of episodes 1 and 2
        (0, 1.0, {"terminated": True}),  # 1: episode 1 acts in "a"
        (0, 0.0, {"truncated": True}),  # 2: episode 2 acts in "a"
        (None, 0.0, {"info": {"state_key": "b"}}),  # 3: turn 0 of episode 3
        (3, 0.0, {"truncated": True}),  # 4: episode 3 acts in "b"
        (None, 0.0, {"error": "env crashed", "truncated": True}),  # 5: a failed episode
    ])
    stats = anchor_group_stats([tree])
    assert stats["anchor/steps"] == 6 and stats["anchor/steps_in_groups_of_2plus"] == 5
    assert stats["anchor/later_steps"] == 3 and stats["anchor/later_steps_in_groups_of_2plus"] == 2
    assert stats["anchor/later_frac_in_groups_of_2plus"] == pytest.approx(2 / 3)
    assert stats["anchor/largest_group"] == 3


# -- exact env keys, per-root openings (from a review) ---------------------------------------
LONG_A = "room=kitchen;holding=apple;door=open;step=01"  # 44 characters
LONG_B = "room=kitchen;holding=apple;door=open;step=02"  # one character apart: ratio 43/44 = 0.977


def test_similarity_never_merges_env_state_keys(make_tree):
    # Two roots with one opening; each root's env names the state its second turn acts in.
    # By hand (gamma 1, scale none): totals [1, 0] -> A_E = +-0.5; turn 0 shares the opening,
    # returns [1, 0] -> A_S = +-0.5; turn 1 acts in two different env states -> A_S = 0.
    # Merging LONG_A and LONG_B (ratio 0.977 >= 0.95) would give turn 1 +-0.5 too.
    tree = make_tree([
        (None, 0.0, {"info": {"state_key": LONG_A}}),
        (0, 1.0, {"terminated": True}),
        (None, 0.0, {"info": {"state_key": LONG_B}}),
        (2, 0.0, {"terminated": True}),
    ])
    out = gigpo_episode_advantages(list(tree.episodes()), tree, gamma=1.0, scale="none", similarity=0.95)
    assert out == [pytest.approx([1.0, 0.5]), pytest.approx([-1.0, -0.5])]


def test_similarity_still_merges_observation_texts(make_tree):
    # As above, without env keys: "you are in the kitchen." and "...kitchen!" (ratio 0.9565)
    # are one anchor state at 0.95, so turn 1's returns [1, 0] give A_S = +-0.5 there too.
    tree = make_tree([
        (None, 0.0, {"observation": "You are in the kitchen."}),
        (0, 1.0, {"terminated": True}),
        (None, 0.0, {"observation": "You are in the kitchen!"}),
        (2, 0.0, {"terminated": True}),
    ])
    out = gigpo_episode_advantages(list(tree.episodes()), tree, gamma=1.0, scale="none", similarity=0.95)
    assert out == [pytest.approx([1.0, 1.0]), pytest.approx([-1.0, -1.0])]


def _two_openings(make_tree):
    """Three one-turn episodes: roots 0 and 2 open with [1, 2, 3], root 1 with [4, 5, 6]
    (another seed); rewards 1, 0, 0."""
    tree = make_tree([(None, 1.0, {"terminated": True}), (None, 0.0, {"terminated": True}),
                      (None, 0.0, {"terminated": True})])
    tree.nodes[1].context_ids = [4, 5, 6]
    return tree


def test_each_root_opens_in_its_own_state(make_tree):
    tree = _two_openings(make_tree)
    episodes = list(tree.episodes())
    keys = [episode_state_keys(e, tree)[0] for e in episodes]
    assert keys[0] == keys[2] != keys[1]
    # By hand (scale none): totals [1, 0, 0], mean 1/3 -> A_E = [2/3, -1/3, -1/3]. Turn 0:
    # roots 0 and 2 share an opening, returns [1, 0] -> A_S = [0.5, -0.5]; root 1 alone -> 0.
    out = gigpo_episode_advantages(episodes, tree, scale="none")
    assert out == [pytest.approx([2 / 3 + 0.5]), pytest.approx([-1 / 3]), pytest.approx([-1 / 3 - 0.5])]


def test_a_tree_wide_reset_key_does_not_name_roots_that_open_differently(make_tree):
    # the engine stores the first reset's state_key in tree.meta; it names every root only
    # when every root opens with the same prompt
    tree = _two_openings(make_tree)
    tree.meta["state_key"] = "reset-key"
    keys = [episode_state_keys(e, tree)[0] for e in tree.episodes()]
    assert keys[0] == keys[2] != keys[1]
    tree.nodes[1].context_ids = [1, 2, 3]
    assert [episode_state_keys(e, tree)[0] for e in tree.episodes()] == ["reset-key"] * 3
