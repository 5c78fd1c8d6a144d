"""agentrl.credit: per-token mapping, the estimator registry and assign()."""

from __future__ import annotations

import logging

import pytest

import agentrl.credit as credit
from agentrl.credit import (
    ESTIMATORS,
    assign,
    assign_report,
    gdpo,
    gigpo_episode_advantages,
    to_token_advantages,
)
from agentrl.types import Episode, Node


@pytest.fixture
def star(make_tree):
    """A root (reward 0) with one leaf per reward; leaf i fails with errors[i] if given."""

    def build(rewards, errors=None):
        errors = errors or {}
        spec = [(None, 0.0, {})]
        spec += [(0, r, {"terminated": True, "error": errors.get(i)}) for i, r in enumerate(rewards)]
        return make_tree(spec)

    return build


def test_public_names_exist():
    for name in credit.__all__:
        assert hasattr(credit, name), name


def test_to_token_advantages_puts_each_turn_on_its_action_tokens():
    root = Node(context_ids=[1, 2, 3], action_ids=[4, 5], logprobs=[0.0, 0.0])
    child = Node(context_ids=[6], action_ids=[7, 8, 9], logprobs=[0.0] * 3)
    ep = Episode.from_path([root, child])
    assert ep.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert to_token_advantages(ep, [0.5, -1.0]) == [0, 0, 0, 0.5, 0.5, 0, -1, -1, -1]
    assert to_token_advantages(ep, 2.0) == [0, 0, 0, 2, 2, 0, 2, 2, 2]
    with pytest.raises(ValueError, match="1 entries but the episode has 2 turns"):
        to_token_advantages(ep, [1.0])


def test_assign_grpo_gives_each_episode_its_group_advantage(star):
    items = assign([star([1, 0, 0, 1])], "grpo")
    assert len(items) == 4
    a = 0.8660254  # GRPO on [1, 0, 0, 1], see test_group
    for (episode, tokens), sign in zip(items, [1, -1, -1, 1], strict=True):
        # tokens: root context (3), root action (2), leaf context (1), leaf action (2)
        assert len(tokens) == len(episode.input_ids) == 8
        assert tokens == pytest.approx([0, 0, 0, sign * a, sign * a, 0, sign * a, sign * a], rel=1e-5)


def test_assign_success_outcome_takes_the_envs_word_over_the_reward(make_tree):
    tree = make_tree([(None, 0.0, {}),
                      (0, 1.0, {"terminated": True}),  # success: rewarded on termination
                      (0, 1.0, {"terminated": True, "info": {"success": False}}),  # the env says no
                      (0, 0.0, {"terminated": True}),
                      (0, 0.0, {"terminated": True, "info": {"success": True}})])  # the env says yes
    items = assign([tree], "grpo", outcome="success")
    signs = [1 if tokens[-1] > 0 else -1 for _, tokens in items]  # outcomes 1, 0, 0, 1
    assert signs == [1, -1, -1, 1]
    assert [credit.episode_outcome(e, "success") for e, _ in items] == [1.0, 0.0, 0.0, 1.0]


def test_failed_episodes_are_excluded_or_zeroed_and_reported(star, caplog):
    tree = star([1, 0, 0, 1, 1], errors={4: "sandbox died"})
    report = assign_report([tree], "grpo", failed="exclude")
    assert report.failed == [(0, 5, "sandbox died")]
    assert len(report.items) == 4
    # the failed episode's reward (1) is not in the baseline: still +-0.866
    assert report.items[0][1][3] == pytest.approx(0.8660254, rel=1e-5)
    zero = assign_report([tree], "grpo", failed="zero")
    assert len(zero.items) == 5
    episode, tokens = zero.items[-1]
    assert episode.error == "sandbox died" and tokens == [0.0] * len(episode.input_ids)
    assert zero.items[0][1][3] == pytest.approx(0.8660254, rel=1e-5)
    with caplog.at_level(logging.WARNING, logger="agentrl.credit"):
        assign([tree], "grpo")
    assert "1 failed episode(s) left out (1x sandbox died)" in caplog.text


def test_failed_episodes_credited_enter_the_baseline_with_the_reward_they_earned(star, caplog):
    """``failed="credit"``: a failed episode is an ordinary one (a harness that exits non-zero on
    the model's output is pushed away from it). Rewards 1, 0, 0, 1 and a failed 0: mean 0.4, sample
    std sqrt(1.2 / 4); the failed episode gets (0 - 0.4) / 0.5477 = -0.7303 on its action tokens."""
    tree = star([1, 0, 0, 1, 0], errors={4: "harness exited 1"})
    report = assign_report([tree], "grpo", failed="credit")
    assert report.failed == [(0, 5, "harness exited 1")]  # still counted, by reason
    assert len(report.items) == 5
    by_error = {bool(ep.error): tokens for ep, tokens in report.items if ep.total_reward == 0}
    assert by_error[True][3] == pytest.approx(-0.7302967, rel=1e-5)
    assert by_error[False][3] == pytest.approx(-0.7302967, rel=1e-5)
    assert report.items[0][1][3] == pytest.approx(1.0954451, rel=1e-5)
    with caplog.at_level(logging.WARNING, logger="agentrl.credit"):
        assign([tree], "grpo", failed="credit")
    assert "1 failed episode(s) credited as ordinary episodes (1x harness exited 1)" in caplog.text


def test_assign_mc_grpo_drops_the_pivot(star):
    report = assign_report([star([1, 3, 4, 10, 2])], "mc_grpo", scale="none")
    assert report.pivots == 1
    # the pivot (reward 3) is gone; the rest get r - 3 on their action tokens
    assert [ep.total_reward for ep, _ in report.items] == [1, 4, 10, 2]
    assert [tokens[3] for _, tokens in report.items] == [-2.0, 1.0, 7.0, -1.0]


def test_assign_gigpo_matches_the_pure_function(star):
    tree = star([1, 0, 0, 1])
    items = assign([tree], "gigpo", gamma=0.5, scale="none")
    per_turn = gigpo_episode_advantages(list(tree.episodes()), tree, gamma=0.5, scale="none")
    for (episode, tokens), turns in zip(items, per_turn, strict=True):
        assert tokens == to_token_advantages(episode, turns)
    # turn 0 is the shared root: returns 0.5 * leaf reward -> +-0.25; A_E = +-0.5
    assert per_turn[0] == pytest.approx([0.75, 1.0])


def test_assign_tree_uses_the_turn_nodes(make_tree):
    tree = make_tree([
        (None, 0.0, {}),
        (0, 0.0, {}),
        (0, 0.0, {}),
        (1, 1.0, {"terminated": True}),
        (1, 0.0, {"truncated": True}),
        (2, 1.0, {"terminated": True}),
    ])
    items = assign([tree], "tree", leaf_norm="none")
    episode, tokens = items[0]  # r0 -> a -> a1: node advantages 0, -1/3, 5/6 (see test_tree)
    assert [n.id for n in episode.nodes] == [0, 1, 3]
    want = to_token_advantages(episode, [0.0, -1 / 3, 5 / 6])
    assert tokens == pytest.approx(want)


def test_assign_gdpo_normalises_across_the_batch(star):
    trees = [star([1, 0, 0]), star([1, 1])]

    def reward_fn(ep):
        return {"ret": ep.total_reward, "bonus": float(ep.nodes[-1].id == 1)}

    items = assign(trees, "gdpo", reward_fn=reward_fn)
    eps = [ep for t in trees for ep in t.episodes()]
    want = gdpo([reward_fn(e) for e in eps], groups=[0, 0, 0, 1, 1])
    assert [tokens[3] for _, tokens in items] == pytest.approx(want)
    with pytest.raises(ValueError, match="needs reward_fn"):
        assign(trees, "gdpo")


def test_assign_returns_without_normalisation(star):
    items = assign([star([1, 0])], "returns", gamma=0.5, level=None)
    # episode 0: rewards [0, 1] -> returns [0.5, 1] on its two turns
    assert items[0][1] == [0, 0, 0, 0.5, 0.5, 0, 1.0, 1.0]


def test_assign_gae_with_a_value_function(star):
    # rewards [0, 1], V = 0.5 on both turns, gamma 1, lam 0.5:
    # delta1 = 1 - 0.5 = 0.5 ; delta0 = 0 + 0.5 - 0.5 = 0 ; A1 = 0.5 ; A0 = 0 + 0.5 * 0.5 = 0.25
    items = assign(
        [star([1])], "gae", gamma=1.0, lam=0.5, value_fn=lambda ep: [0.5] * ep.num_turns, level=None
    )
    assert items[0][1] == [0, 0, 0, 0.25, 0.25, 0, 0.5, 0.5]
    with pytest.raises(TypeError, match="unknown options"):
        assign([star([1])], "gae", omega=1.0)


def test_assign_gae_bootstraps_from_a_value_after_the_last_turn(star):
    # A value function may give one value more: V of the state after the last turn, for an
    # episode cut short. rewards [0, 1], V = [0.5, 0.5], bootstrap 2, gamma 1, lam 0.5:
    # delta1 = 1 + 2 - 0.5 = 2.5 ; delta0 = 0 + 0.5 - 0.5 = 0 ; A1 = 2.5 ; A0 = 0 + 0.5 * 2.5 = 1.25
    cut = star([1])
    leaf = next(n for n in cut.nodes.values() if not n.children)
    leaf.terminated, leaf.truncated = False, True
    value_fn = lambda ep: [0.5] * ep.num_turns + [2.0]  # noqa: E731
    items = assign([cut], "gae", gamma=1.0, lam=0.5, level=None, value_fn=value_fn)
    assert items[0][1] == [0, 0, 0, 1.25, 1.25, 0, 2.5, 2.5]
    # The env ended star's episodes: no state after the last turn, so the bootstrap is 0 and
    # the result is the one without it (test_assign_gae_with_a_value_function).
    items = assign([star([1])], "gae", gamma=1.0, lam=0.5, level=None, value_fn=value_fn)
    assert items[0][1] == [0, 0, 0, 0.25, 0.25, 0, 0.5, 0.5]
    with pytest.raises(ValueError, match="value_fn gave 4 values for an episode of 2 turns"):
        assign([star([1])], "gae", value_fn=lambda ep: [0.0] * 4)


def test_assign_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown credit method 'ppo'; choose one of"):
        assign([], "ppo")
    with pytest.raises(ValueError, match="failed must be"):
        assign([], "grpo", failed="drop")
    assert sorted(ESTIMATORS) == sorted(
        ["grpo", "dr_grpo", "rloo", "mc_grpo", "gigpo", "tree", "gdpo", "returns", "gae"]
    )
    assert assign([], "grpo") == []
