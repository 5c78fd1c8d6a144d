"""Losses on hand-computed cases: PPO-clip (clip-higher, dual-clip), aggregations, KL, TIS, staleness, M2PO."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config
from agentrl.train.loss import (
    PolicyLossConfig,
    aggregate,
    entropy_bonus,
    kl_penalty,
    kl_per_token,
    mean_denominator,
    mismatch_stats,
    policy_loss,
    ppo_clip_loss,
    ppo_clip_token_loss,
    staleness_mask,
    tis_weights,
    weight_negatives,
)
from agentrl.train.m2po import m2po_mask, m2po_trust_region


def _lp(*ratios):
    """Logprobs (with grad) whose ratio to old logprobs of 0 are ``ratios``."""
    return torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)


# --------------------------------------------------------------------------- PPO-clip


def test_ppo_clip_hand_case_with_clip_higher():
    lp = _lp(1.5, 0.5, 1.0, 1.1)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token: max(-1.5, -1.28) = -1.28 | max(0.5, 0.8) = 0.8 | -2.0 | max(1.1, 1.1) = 1.1
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.0 + 1.1) / 4)
    loss.backward()
    # clipped tokens get no gradient; d(-A r)/d logp = -A r for the others
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, -2.0 / 4, 1.1 / 4])
    assert stats["clip_frac_high"] == pytest.approx(0.25)
    assert stats["clip_frac_low"] == pytest.approx(0.25)
    assert stats["clip_frac_dual"] == 0.0
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 1.1) / 4)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 1.1)]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)


def test_symmetric_clip_would_clip_a_ratio_that_clip_higher_keeps():
    lp, old, adv, mask = _lp(1.25), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    higher, _ = ppo_clip_token_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    symmetric, _ = ppo_clip_token_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert higher.item() == pytest.approx(-1.25)
    assert symmetric.item() == pytest.approx(-1.2)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    lp = _lp(5.0, 5.0)
    adv = torch.tensor([[-1.0, 1.0]])
    per_token, stats = ppo_clip_token_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip=3.0)
    # A < 0, r = 5: max(5, 0.8) = 5, capped at -c A = 3; A > 0 is untouched: -1.28
    assert per_token[0].tolist() == pytest.approx([3.0, -1.28])
    assert stats["clip_frac_dual"] == pytest.approx(0.5)
    per_token.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_token_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip=0.9)


def test_a_token_with_advantages_of_both_signs_is_clipped_per_sign_hand_case():
    """A token shared by episodes with A = 2, 0.5 and -1 (tree packing) carries (2.5, -1): the clip is per sign."""
    lp = _lp(1.5)  # r = 1.5 > 1 + clip_high
    per_token, stats = ppo_clip_token_loss(lp, torch.zeros(1, 1), torch.tensor([[[2.5, -1.0]]]), torch.ones(1, 1))
    # A > 0: max(-2.5 * 1.5, -2.5 * 1.28) = -3.2 (clipped); A < 0: max(1.5, 1.28) = 1.5. The summed
    # advantage 1.5 would give -1.5 * 1.28 = -1.92, and no gradient.
    assert per_token.item() == pytest.approx(-3.2 + 1.5)
    per_token.sum().backward()
    assert lp.grad.item() == pytest.approx(1.5)  # only the A < 0 copy: d(|A| r)/d logp = r
    assert stats["clip_frac_high"] == 1.0


def test_masked_tokens_do_not_count():
    lp = _lp(1.0, 1.0)
    loss, stats = ppo_clip_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, 100.0]]), torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-1.0)
    assert stats["ratio_mean"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- aggregation


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(("agg", "norm_len", "expected"), [
    ("token-mean", None, 10 / 4),
    ("seq-mean-token-mean", None, (6 / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", 4, (6 / 4 + 4 / 4) / 2),
])
def test_aggregations_hand_case(agg, norm_len, expected):
    assert aggregate(VALUES, MASK, agg, norm_len=norm_len).item() == pytest.approx(expected)


def test_seq_ids_group_packed_tokens_like_rows():
    packed = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    seq_ids = torch.tensor([[7, 7, 7, 3]])
    got = aggregate(packed, torch.ones(1, 4), "seq-mean-token-mean", seq_ids=seq_ids)
    assert got.item() == pytest.approx(3.0)


def test_a_sequence_with_no_action_token_is_left_out():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert aggregate(VALUES, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)


@pytest.mark.parametrize(("agg", "denominator"), [("token-mean", 4.0), ("seq-mean-token-mean", 2.0),
                                                  ("seq-mean-token-sum-norm", 2.0)])
def test_parts_divided_by_the_whole_denominator_add_up_to_the_whole_mean(agg, denominator):
    """How a minibatch split into rows keeps its mean: each row divides by the minibatch's count."""
    assert mean_denominator(MASK, agg) == denominator  # 4 tokens, 2 sequences
    whole = aggregate(VALUES, MASK, agg, norm_len=4)
    parts = [aggregate(VALUES[i:i + 1], MASK[i:i + 1], agg, norm_len=4, denominator=denominator) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item())
    # Each row's own mean would give the wrong weights: 6/3 and 4/1 for the token mean.
    assert aggregate(VALUES[:1], MASK[:1], "token-mean").item() == 2.0


def test_aggregate_rejects_bad_options():
    with pytest.raises(ValueError, match="agg"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------- KL, entropy


@pytest.mark.parametrize(("estimator", "expected"), [
    ("k1", math.log(2)),                     # log pi - log ref = log 0.5 - log 0.25
    ("k2", 0.5 * math.log(2) ** 2),
    ("k3", 0.5 - 1 + math.log(2)),           # r - 1 - log r with r = 0.25 / 0.5
])
def test_kl_estimators_hand_case(estimator, expected):
    lp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    assert kl_penalty(lp, ref, torch.ones(1, 2), estimator).item() == pytest.approx(expected)


@pytest.mark.parametrize(("estimator", "minimises"), [("k1", None), ("k2", "KL(pi||ref)"),
                                                     ("k3", "KL(ref||pi)")])
def test_kl_estimators_expected_gradient_on_an_enumerated_categorical(estimator, minimises):
    """E_{x ~ pi}[grad k(x)], summed exactly over a 5-way categorical, against the exact gradients.

    The estimate is differentiated through log pi(x) only, as in the loss (the sampling is not
    differentiated): k1 gives 0, k2 the gradient of KL(pi || ref), k3 that of KL(ref || pi).
    """
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.1, 1.0, -1.0], dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    expected = (logp.exp().detach() * kl_per_token(logp, ref, estimator)).sum()
    (grad,) = torch.autograd.grad(expected, theta, retain_graph=True)
    p, q = logp.exp(), ref.exp()
    exact = {"KL(pi||ref)": (p * (logp - ref)).sum(), "KL(ref||pi)": (q * (ref - logp)).sum()}
    grads = {k: torch.autograd.grad(v, theta, retain_graph=True)[0] for k, v in exact.items()}
    assert (grads["KL(pi||ref)"] - grads["KL(ref||pi)"]).abs().max() > 0.05  # the two directions differ here
    if minimises is None:
        torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-12, rtol=0)
    else:
        torch.testing.assert_close(grad, grads[minimises], atol=1e-12, rtol=1e-9)


def test_k1_is_refused_as_a_loss_term_naming_its_key():
    from agentrl.errors import ConfigError
    from agentrl.train.config import load_train_config

    with pytest.raises(ValueError, match="kl_estimator"):
        PolicyLossConfig(kl_coef=0.1, kl_estimator="k1")
    assert PolicyLossConfig(kl_estimator="k1").kl_coef == 0.0  # no term, nothing to refuse
    with pytest.raises(ConfigError, match=r"train\.loss\.kl_estimator"):
        load_train_config(None, ["train.loss={kl_coef: 0.1, kl_estimator: k1}"])


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k4")


def test_entropy_bonus_is_the_masked_mean():
    assert entropy_bonus(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]])).item() == 2.0


# --------------------------------------------------------------------------- off-policy corrections


def test_tis_weights_truncate_and_are_detached():
    trainer = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]], requires_grad=True)
    w = tis_weights(trainer, torch.zeros(1, 3), cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert not w.requires_grad


def test_staleness_mask_hand_case():
    versions = torch.tensor([[3, 2, 0, -1]])
    assert staleness_mask(versions, current_version=3, max_staleness=1)[0].tolist() == [
        True, True, False, False]
    with pytest.raises(ValueError, match="current_version"):
        staleness_mask(versions, current_version=2, max_staleness=1)


def test_m2po_drops_the_largest_squared_log_ratio_hand_case():
    logratio = torch.tensor([[0.1, -0.3, 0.5, 0.05, 9.0]])
    advantages = torch.sign(logratio)  # every token in the trust region: A > 0 and r > 1, or A < 0 and r < 1
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # s = .01, .09, .25, .0025; running means of the ascending sort: .0025, .00625, .0342, .0881
    keep = m2po_mask(logratio, advantages, mask, tau=0.04)
    assert keep[0].tolist() == [True, True, False, True, False]


def test_m2po_masks_trust_region_tokens_only_hand_case():
    """Zheng et al. 2025, Algorithm 1: M2 and the mask are over the trust-region tokens T only."""
    logratio = torch.tensor([[0.3, -0.1, 0.02, 1.0, -0.6, 0.7, 0.0]])
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0]])
    mask = torch.ones(1, 7)
    # T = tokens 0-3 (A > 0, r > 1 or A < 0, r < 1); 4 (A > 0, r < 1), 5 (A < 0, r > 1) and 6 (r = 1)
    # are not in T. T's s = .09, .01, .0004, 1: ascending running means .0004, .0052, .0335, .2751,
    # so token 3 goes and M2 over T is .0335 <= .04. Over all tokens (the old rule) 4 and 5,
    # with s = .36 and .49, would go too.
    assert m2po_trust_region(logratio, advantages, mask)[0].tolist() == [True] * 4 + [False] * 3
    assert m2po_mask(logratio, advantages, mask, tau=0.04)[0].tolist() == [True, True, True, False, True, True, True]


def test_m2po_loss_is_the_unclipped_ratio_times_a_over_all_tokens_hand_case():
    """J_M2PO = (1 / sum |o_i|) sum M r A: no clip (token 0's r = 1.35 > 1 + clip_high keeps its
    gradient), no TIS, and the masked token 3 stays in the denominator (7, not 6)."""
    logratio = [0.3, -0.1, 0.02, 1.0, -0.6, 0.7, 0.0]
    adv = [1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0]
    lp = torch.tensor([logratio], requires_grad=True)
    cfg = PolicyLossConfig(m2po_tau=0.04)  # tis_cap keeps its default 2.0: M2PO does not apply it
    loss, stats = policy_loss(lp, torch.tensor([adv]), torch.ones(1, 7), cfg, behaviour_logprobs=torch.zeros(1, 7))
    kept = [1, 1, 1, 0, 1, 1, 1]
    terms = [-m * math.exp(x) * a for x, a, m in zip(logratio, adv, kept, strict=True)]
    assert loss.item() == pytest.approx(sum(terms) / 7)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([t / 7 for t in terms])  # d(-M r A)/d logp = -M r A
    assert stats["tis/on"] == 0.0 and "ppo/clip_frac_high" not in stats
    assert stats["mask/kept_frac"] == pytest.approx(6 / 7)
    assert stats["m2po/masked_frac"] == pytest.approx(1 / 7)
    assert stats["m2po/m2"] == pytest.approx((0.09 + 0.01 + 0.0004 + 1.0) / 4)
    assert stats["m2po/m2_kept"] == pytest.approx((0.09 + 0.01 + 0.0004) / 3)


def _m2po_reference(s: list[float], candidates: set[int], tau: float) -> set[int]:
    """Algorithm 1 as written: while the mean of s over T exceeds tau, mask T's largest."""
    masked, t = set(), set(candidates)
    while t and sum(s[i] for i in t) / len(t) > tau:
        j = max(t, key=lambda i: s[i])
        masked.add(j)
        t.remove(j)
    return masked


def test_a_token_m2po_masks_for_an_infinite_ratio_leaves_the_loss_and_its_gradient_finite():
    """M2PO masks the tokens with the largest (log r)^2, a sampler's -inf logprob (r = inf) first.
    Masking multiplied by 0, and inf * 0 made the whole loss NaN; now the masked token is 0 and the
    rest is the hand-computed -(e^0.1 * 1) / 2 (both tokens in the mean), with finite gradients."""
    lp = torch.zeros(1, 2, requires_grad=True)
    behaviour = torch.tensor([[-0.1, float("-inf")]])
    cfg = PolicyLossConfig(m2po_tau=0.04)
    loss, stats = policy_loss(lp, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), cfg, behaviour_logprobs=behaviour)
    assert loss.item() == pytest.approx(-math.exp(0.1) / 2)
    assert stats["m2po/masked_frac"] == 0.5 and math.isfinite(stats["m2po/ratio_mean"])
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.1) / 2, 0.0])


def test_m2po_matches_the_iterative_rule_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logratio = torch.randn(3, 7, generator=g) * 0.3
        advantages = torch.randn(3, 7, generator=g)
        mask = torch.rand(3, 7, generator=g) < 0.7
        keep = m2po_mask(logratio, advantages, mask, tau=0.04)
        lr, a = logratio[mask].tolist(), advantages[mask].tolist()
        tr = {i for i in range(len(lr)) if (a[i] > 0 and lr[i] > 0) or (a[i] < 0 and lr[i] < 0)}
        masked = _m2po_reference([x * x for x in lr], tr, 0.04)
        assert set(keep[mask].nonzero().flatten().tolist()) == set(range(len(lr))) - masked
        assert not (keep & ~mask).any()


def test_mismatch_stats_hand_case():
    stats = mismatch_stats(torch.tensor([[0.0, math.log(2.0), 5.0]]), torch.zeros(1, 3),
                           torch.tensor([[1, 1, 0]]))
    assert stats["mismatch_kl"] == pytest.approx((0.0 + 2.0 - 1.0 - math.log(2.0)) / 2)
    assert stats["max_abs_dlogprob"] == pytest.approx(math.log(2.0))


def test_mismatch_stats_say_infinite_where_one_side_gave_a_token_no_probability():
    # The sampler gave the token probability 0 (a constrained or filtered sampler), the trainer
    # e^-1: r = inf, so r - 1 - log r is inf, not inf - inf = nan; a nan hid the worst mismatch.
    stats = mismatch_stats(torch.tensor([[-1.0, 0.0]]), torch.tensor([[-math.inf, 0.0]]),
                           torch.ones(1, 2))
    assert stats == {"mismatch_kl": math.inf, "max_abs_dlogprob": math.inf}
    stats = mismatch_stats(torch.tensor([[-math.inf]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert stats == {"mismatch_kl": math.inf, "max_abs_dlogprob": math.inf}
    # Far apart but finite in float64 terms: exp overflows float32, the k3 term is still large, not nan.
    stats = mismatch_stats(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.ones(1, 1))
    assert stats["mismatch_kl"] == math.inf and stats["max_abs_dlogprob"] == pytest.approx(100.0)
    # Both -inf: they agree.
    stats = mismatch_stats(torch.tensor([[-math.inf, math.log(2.0)]]), torch.tensor([[-math.inf, 0.0]]),
                           torch.ones(1, 2))
    assert stats["mismatch_kl"] == pytest.approx((2.0 - 1.0 - math.log(2.0)) / 2)
    assert stats["max_abs_dlogprob"] == pytest.approx(math.log(2.0))


# --------------------------------------------------------------------------- the composed loss


def test_policy_loss_on_policy_is_the_plain_policy_gradient():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, stats = policy_loss(lp, adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0 / 3, 2.0 / 3, -0.5 / 3])
    assert stats["tis/on"] == 0.0 and stats["mask/kept_frac"] == 1.0


def test_weight_negatives_scales_only_negative_advantages():
    adv = torch.tensor([[1.0, -2.0, 0.0, -0.5]])
    assert weight_negatives(adv, 0.25).tolist() == [[1.0, -0.5, 0.0, -0.125]]
    assert weight_negatives(adv, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert weight_negatives(adv, 1.0) is adv


def test_policy_loss_negative_weight_zero_is_positive_sample_reinforcement():
    # PSR: the A < 0 token leaves the gradient; the mean still divides by all 3 tokens.
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, _ = policy_loss(lp, adv, torch.ones(1, 3), PolicyLossConfig(negative_weight=0.0))
    assert loss.item() == pytest.approx(-(1.0 + 0.5) / 3)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0 / 3, 0.0, -0.5 / 3])
    with pytest.raises(ValueError, match="negative_weight"):
        PolicyLossConfig(negative_weight=1.5)


def test_policy_loss_composes_tis_staleness_kl_and_entropy():
    lp = torch.zeros(1, 4, requires_grad=True)  # ratio 1 everywhere
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    behaviour = torch.tensor([[0.0, math.log(0.5), math.log(4.0), 0.0]])  # TIS: 1, 2, 0.25, 1
    versions = torch.tensor([[4, 4, 4, 1]])  # the last token is too stale
    ref = torch.tensor([[math.log(0.5)] * 4])
    ent = torch.tensor([[2.0, 4.0, 6.0, 100.0]])
    cfg = PolicyLossConfig(tis_cap=2.0, max_token_staleness=2, kl_coef=0.1, kl_estimator="k2",
                           entropy_coef=0.01)
    loss, stats = policy_loss(lp, adv, torch.ones(1, 4), cfg, behaviour_logprobs=behaviour,
                              versions=versions, current_version=4, ref_logprobs=ref, entropies=ent)
    pg = (-1.0 * 1 - 1.0 * 2 + 1.0 * 0.25) / 3
    kl = 0.5 * math.log(2.0) ** 2  # k2: (log 0.5 - 0)^2 / 2
    entropy = (2.0 + 4.0 + 6.0) / 3
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * entropy)
    assert stats["mask/kept_frac"] == pytest.approx(0.75)
    assert stats["tis/capped_frac"] == pytest.approx(1 / 3)
    assert stats["loss/pg"] == pytest.approx(pg)


def test_policy_loss_m2po_masks_the_off_policy_token():
    lp = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.tensor([[0.0, 0.1, -2.0]])  # log ratios 0, -0.1, 2; A = 1: only token 2 in T, M2 = 4
    loss, stats = policy_loss(lp, torch.ones(1, 3), torch.ones(1, 3),
                              PolicyLossConfig(m2po_tau=0.04, tis_cap=None),
                              behaviour_logprobs=behaviour)
    assert stats["mask/kept_frac"] == pytest.approx(2 / 3)
    assert loss.item() == pytest.approx(-(1.0 + math.exp(-0.1)) / 3)  # -r A over all three tokens
    assert stats["mismatch/max_abs_dlogprob"] == pytest.approx(2.0)


def test_policy_loss_options_without_their_inputs_fail_loudly():
    lp, adv, mask = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    for cfg, word in ((PolicyLossConfig(max_token_staleness=1), "versions"),
                      (PolicyLossConfig(m2po_tau=0.1), "behaviour_logprobs"),
                      (PolicyLossConfig(kl_coef=0.1), "ref_logprobs"),
                      (PolicyLossConfig(entropy_coef=0.1), "entropies")):
        with pytest.raises(ValueError, match=word):
            policy_loss(lp, adv, mask, cfg)


def test_m2po_refuses_several_advantages_per_token():
    """Several advantages per token (tree packing's layout): refused by the loss; the config
    refuses tree_packing with M2PO before that (tests/train/test_tree_training.py)."""
    with pytest.raises(ValueError, match="M2PO needs one advantage per token"):
        policy_loss(torch.zeros(1, 2), torch.ones(1, 2, 2), torch.ones(1, 2), PolicyLossConfig(m2po_tau=0.04),
                    behaviour_logprobs=torch.zeros(1, 2), masks=None)


def test_policy_loss_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="clip_hihg"):
        PolicyLossConfig(clip_hihg=0.3)


def test_the_old_name_max_staleness_still_masks_tokens_for_one_release_with_a_warning():
    with pytest.warns(FutureWarning, match=r"train\.loss\.max_staleness is deprecated.*"
                                           r"use train\.loss\.max_token_staleness"):
        old = PolicyLossConfig(max_staleness=1)
    assert old == PolicyLossConfig(max_token_staleness=1)
    with pytest.warns(FutureWarning, match="train.loss.max_token_staleness"):
        cfg = load_train_config(None, ["train.loss={max_staleness: 2}"])
    assert cfg.train.loss.max_token_staleness == 2
    with pytest.raises(ConfigError, match=r"train\.loss\.max_staleness is the old name"):
        load_train_config(None, ["train.loss={max_staleness: 2, max_token_staleness: 2}"])
