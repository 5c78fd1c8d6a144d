"""agentrl.credit.registry: every method dispatched through ESTIMATORS gives the advantages it gave
before the registry (pinned on one fixed batch), and its options model matches its function."""

from __future__ import annotations

import inspect

import pytest

from agentrl.credit import ESTIMATORS, assign, assign_report, credit_options, to_token_advantages
from agentrl.credit_options import CREDIT_OPTIONS, GiGPOOptions, TreeOptions

from .conftest import build_tree


def batch():
    """Two trees. A: two branches through one anchor state "s1"; leaves 3 (return 1), 4 (0),
    5 (0.5) and 6, which failed. B: a star of four leaves with returns 1, 0, 0, 2."""
    a = build_tree([
        (None, 0.0, {}),
        (0, 0.0, {"info": {"state_key": "s1"}}),
        (0, 0.0, {"info": {"state_key": "s1"}}),
        (1, 1.0, {"terminated": True}),
        (1, 0.0, {"terminated": True}),
        (2, 0.5, {"terminated": True}),
        (2, 1.0, {"terminated": True, "error": "sandbox died"}),
    ])
    b = build_tree([(None, 0.0, {}), (0, 1.0, {"terminated": True}), (0, 0.0, {"terminated": True}),
                    (0, 0.0, {"terminated": True}), (0, 2.0, {"truncated": True})])
    return [a, b]


def reward_fn(ep):
    return {"ret": ep.total_reward, "long": float(ep.num_turns > 2)}


def values(ep):
    return [0.25 * (t + 1) for t in range(ep.num_turns)]


# (method, options) -> [(leaf id, per-turn advantages)], in the order assign returns them (tree A's
# kept leaves, then B's). Pinned from the if/elif dispatch this registry replaced (same batch, same
# options); the comments give the hand computation where it is short.
CASES = {
    # A: outcomes [1, 0, 0.5], mean 0.5, sample std 0.5; B: [1, 0, 0, 2], mean 0.75
    "grpo": (("grpo", {}), [
        (3, [0.999998] * 3), (4, [-0.999998] * 3), (5, [0.0] * 3),
        (1, [0.2611162] * 2), (2, [-0.7833486] * 2), (3, [-0.7833486] * 2), (4, [1.3055811] * 2)]),
    "dr_grpo": (("dr_grpo", {}), [  # r - mean
        (3, [0.5] * 3), (4, [-0.5] * 3), (5, [0.0] * 3),
        (1, [0.25] * 2), (2, [-0.75] * 2), (3, [-0.75] * 2), (4, [1.25] * 2)]),
    "rloo": (("rloo", {}), [  # r - mean of the others: 1 - 0.25; 1 - 2/3; 2 - 1/3
        (3, [0.75] * 3), (4, [-0.75] * 3), (5, [0.0] * 3),
        (1, [1 / 3] * 2), (2, [-1.0] * 2), (3, [-1.0] * 2), (4, [5 / 3] * 2)]),
    "mc_grpo": (("mc_grpo", {}), [  # A's median episode (leaf 5) is the pivot: left out
        (3, [0.999998] * 3), (4, [-0.999998] * 3),
        (1, [0.5222324] * 2), (2, [-0.5222324] * 2), (3, [-0.5222324] * 2), (4, [1.5666973] * 2)]),
    "mc_grpo_none": (("mc_grpo", {"scale": "none"}), [  # r - median; B is even: median 0.5, no pivot
        (3, [0.5] * 3), (4, [-0.5] * 3),
        (1, [0.5] * 2), (2, [-0.5] * 2), (3, [-0.5] * 2), (4, [1.5] * 2)]),
    "gigpo": (("gigpo", {"gamma": 0.9, "omega": 0.5}), [
        (3, [1.4999968, 1.4999969, 1.499997]), (4, [-1.4999968, -1.4999969, -1.499997]), (5, [0.0] * 3),
        (1, [0.3916743, 0.3916743]), (2, [-1.1750229, -1.175023]), (3, [-1.1750229, -1.175023]),
        (4, [1.9583715, 1.9583716])]),
    "tree": (("tree", {}), [  # A: V(leaf 3) - V(n1) = 0.5 and - V(root) = 0.5, over sqrt(1) leaf
        (3, [0.0, 0.0, 1.0]), (4, [0.0, 0.0, -1.0]), (5, [0.0] * 3),
        (1, [0.0, 0.5]), (2, [0.0, -1.5]), (3, [0.0, -1.5]), (4, [0.0, 2.5])]),
    "tree_contrastive": (("tree", {"contrastive": True, "leaf_norm": "none"}), [
        (3, [0.0, 0.0, 1.999996]), (4, [0.0, 0.0, -1.999996]), (5, [0.0] * 3),
        (1, [0.0, 0.603022]), (2, [0.0, -1.8090659]), (3, [0.0, -1.8090659]), (4, [0.0, 3.0151098])]),
    "gdpo": (("gdpo", {"reward_fn": reward_fn, "weights": {"ret": 1.0, "long": 0.5}}), [
        (3, [1.0954433] * 3), (4, [-1.0954433] * 3), (5, [0.0] * 3),
        (1, [0.2860386] * 2), (2, [-0.8581157] * 2), (3, [-0.8581157] * 2), (4, [1.4301929] * 2)]),
    "returns": (("returns", {"gamma": 0.9}), [
        (3, [0.962817, 1.2046408, 1.4733339]), (4, [-1.2135972] * 3), (5, [-0.1253901, -0.0044782, 0.1298683]),
        (1, [0.2374378, 0.3640713]), (2, [-0.9022636] * 2), (3, [-0.9022636] * 2), (4, [1.3771392, 1.6304062])]),
    "returns_batch": (("returns", {"gamma": 0.9, "level": "batch"}), [
        (3, [0.3803095, 0.5255963, 0.6870261]), (4, [-0.9272716] * 3), (5, [-0.273481, -0.2008376, -0.1201227]),
        (1, [0.5255963, 0.6870261]), (2, [-0.9272716] * 2), (3, [-0.9272716] * 2), (4, [1.9784642, 2.3013238])]),
    # leaf 3: rewards [0, 0, 1], V [0.25, 0.5, 0.75], gamma 0.9, lam 0.8, terminated (bootstrap 0):
    # deltas 0.2, 0.175, 0.25; A2 = 0.25, A1 = 0.175 + 0.72 * 0.25 = 0.355, A0 = 0.2 + 0.72 * 0.355 = 0.4556
    "gae": (("gae", {"gamma": 0.9, "lam": 0.8, "level": None, "value_fn": values}), [
        (3, [0.4556, 0.355, 0.25]), (4, [-0.0628, -0.365, -0.75]), (5, [0.1964, -0.005, -0.25]),
        (1, [0.56, 0.5]), (2, [-0.16, -0.5]), (3, [-0.16, -0.5]), (4, [1.28, 1.5])]),
}


@pytest.mark.parametrize("case", CASES)
def test_every_method_gives_the_pinned_advantages_and_zeroes_the_failed_episode(case):
    (method, options), want = CASES[case]
    report = assign_report(batch(), method, **options)
    assert report.failed == [(0, 6, "sandbox died")]
    assert report.pivots == (1 if method == "mc_grpo" else 0)
    assert [ep.nodes[-1].id for ep, _ in report.items] == [leaf for leaf, _ in want]
    for (episode, tokens), (_, turns) in zip(report.items, want, strict=True):
        assert tokens == pytest.approx(to_token_advantages(episode, turns), abs=1e-6)
    zero = assign_report(batch(), method, failed="zero", **options)
    failed = [(ep, tokens) for ep, tokens in zero.items if ep.error]
    assert len(failed) == 1 and failed[0][1] == [0.0] * len(failed[0][0].input_ids)
    assert [t for ep, t in zero.items if not ep.error] == [t for _, t in report.items]
    # failed="credit": exactly the advantages of the same batch with no failure recorded
    credited = assign_report(batch(), method, failed="credit", **options)
    assert credited.failed == [(0, 6, "sandbox died")]
    healed = batch()
    healed[0].nodes[6].error = None
    plain = assign_report(healed, method, **options)
    assert [(ep.nodes[-1].id, t) for ep, t in credited.items] == [(ep.nodes[-1].id, t) for ep, t in plain.items]
    assert len(credited.items) == 8 - credited.pivots  # every leaf of both trees, the failed one too


def test_each_estimator_has_its_options_model_whose_defaults_are_its_functions():
    assert set(ESTIMATORS) == set(CREDIT_OPTIONS)
    for name, est in ESTIMATORS.items():
        assert est.options is CREDIT_OPTIONS[name] and est.options().name == name
        params = inspect.signature(est.fn).parameters
        for key, field in est.options.model_fields.items():
            if key in ("name", "level"):  # level: the dispatch's default ("group"), not normalize's
                continue
            if key == "outcome" and key not in params:  # the group functions take outcomes already
                continue
            assert params[key].default == field.default, (name, key)
    assert {n for n, e in ESTIMATORS.items() if e.scope == "batch"} == {"gdpo", "returns", "gae"}
    assert [n for n, e in ESTIMATORS.items() if e.pivot] == ["mc_grpo"]


def test_a_method_takes_its_options_model_as_well_as_its_name():
    by_name = assign(batch(), "gigpo", gamma=0.9, omega=0.5)
    by_model = assign(batch(), GiGPOOptions(gamma=0.9, omega=0.5))
    assert [t for _, t in by_model] == [t for _, t in by_name]
    updated = assign(batch(), GiGPOOptions(gamma=0.9), omega=0.5)  # keywords update the model
    assert [t for _, t in updated] == [t for _, t in by_name]
    assert credit_options(TreeOptions(contrastive=True), leaf_norm="none") == TreeOptions(
        contrastive=True, leaf_norm="none")


def test_outcome_is_an_option_of_the_methods_that_compare_outcomes():
    # B's outcomes by success (a terminal reward of at least 1): leaves 1 and 4 (truncated: no)
    by_keyword = assign(batch(), "dr_grpo", outcome="success")
    by_option = assign(batch(), "dr_grpo", **{"outcome": "success"})
    by_callable = assign(batch(), "dr_grpo", outcome=lambda ep: float(ep.success))
    assert [t for _, t in by_keyword] == [t for _, t in by_option] == [t for _, t in by_callable]
    # A: successes [1, 0, 0] -> 2/3, -1/3, -1/3; B: [1, 0, 0, 0] -> 0.75, -0.25, -0.25, -0.25
    assert [t[3] for _, t in by_keyword] == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.75, -0.25, -0.25, -0.25])


def test_bad_options_and_inputs_name_what_is_wrong():
    with pytest.raises(TypeError, match=r"unknown options for method='gigpo': \['gama'\]; valid: gamma, omega"):
        assign(batch(), "gigpo", gama=0.9)
    with pytest.raises(ValueError, match=r"credit method gigpo: option 'gamma': Input should be less than or equal to 1"):
        assign(batch(), "gigpo", gamma=1.5)
    with pytest.raises(ValueError, match=r"unknown credit method 'gipgo' \(did you mean 'gigpo'\?\); choose one of"):
        assign(batch(), "gipgo")
    with pytest.raises(TypeError, match="unknown options for method='gigpo': \\['outcome'\\]"):
        assign(batch(), "gigpo", outcome="success")  # GiGPO compares rewards, not outcomes
    with pytest.raises(TypeError, match="credit method 'returns' does not read value_fn"):
        assign(batch(), "returns", value_fn=values)
    with pytest.raises(TypeError, match="credit method 'grpo' does not read reward_fn"):
        assign(batch(), "grpo", reward_fn=reward_fn)
