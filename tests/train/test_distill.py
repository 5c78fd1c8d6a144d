"""On-policy distillation signals on hand-computed cases, and one learning check on the tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from agentrl.train.distill import (
    combine_rl_and_distill,
    expert_one_hot_teacher,
    forward_kl,
    informative_token_mask,
    jsd,
    linear_schedule,
    local_support_matching,
    overlap_stop,
    reverse_kl_advantage,
    spread_turn_values,
    step_divergence_weights,
    topk_reverse_kl,
    turn_balance_weights,
)
from agentrl.train.logprobs import token_logprobs

LN = math.log

# --------------------------------------------------------------------------- signals


def test_reverse_kl_advantage_hand_case():
    student = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = reverse_kl_advantage(student, torch.tensor([-0.5, -3.0]))
    assert adv.tolist() == pytest.approx([0.5, -1.0])
    assert not adv.requires_grad


def test_topk_reverse_kl_hand_case():
    student = torch.tensor([[LN(0.5), LN(0.3)]])
    teacher = torch.tensor([[LN(0.25), LN(0.3)]])
    # 0.5 (ln .5 - ln .25) + 0.3 * 0
    assert topk_reverse_kl(student, teacher).item() == pytest.approx(0.5 * LN(2))
    assert topk_reverse_kl(student, teacher, k=1).item() == pytest.approx(0.5 * LN(2))
    special = torch.tensor([[True, False]])
    assert topk_reverse_kl(student, teacher, special_mask=special).item() == pytest.approx(0.0)


def test_local_support_matching_renormalises_both_hand_case():
    student = torch.tensor([LN(0.5), LN(0.3), LN(0.1)])
    teacher = torch.tensor([LN(0.25), LN(0.25), LN(0.5)])
    # S = first two: q_s = (.625, .375), q_t = (.5, .5)
    expected = 0.625 * LN(0.625 / 0.5) + 0.375 * LN(0.375 / 0.5)
    assert local_support_matching(student, teacher, k=2).item() == pytest.approx(expected)
    # Same relative preferences on S, different mass outside it: 0
    assert local_support_matching(torch.tensor([LN(0.4), LN(0.2)]),
                                  torch.tensor([LN(0.1), LN(0.05)])).item() == pytest.approx(0.0, abs=1e-7)
    # Every candidate special: an empty support contributes 0, not NaN
    assert local_support_matching(student, teacher, special_mask=torch.ones(3, dtype=torch.bool)).item() == 0.0


def test_forward_kl_hand_case_and_zero_probabilities():
    assert forward_kl(torch.tensor([LN(0.25), LN(0.75)]),
                      torch.tensor([LN(0.5), LN(0.5)])).item() == pytest.approx(0.5 * LN(2) + 0.5 * LN(2 / 3))
    inf = float("-inf")
    assert forward_kl(torch.tensor([LN(0.5), LN(0.5)]), torch.tensor([0.0, inf])).item() == pytest.approx(LN(2))


def test_jsd_hand_cases():
    inf = float("-inf")
    p, q = torch.tensor([0.0, inf]), torch.tensor([inf, 0.0])  # disjoint point masses
    assert jsd(p, q, 0.5).item() == pytest.approx(LN(2))
    # beta = 0.25: m = (0.25, 0.75); 0.25 KL(t||m) + 0.75 KL(s||m) with t = (1, 0), s = (0, 1)
    assert jsd(p, q, 0.25).item() == pytest.approx(0.25 * LN(4) + 0.75 * LN(1 / 0.75))
    same = torch.log(torch.tensor([0.2, 0.8]))
    assert jsd(same, same, 0.3).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="beta"):
        jsd(p, q, 1.0)


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize(("progress", "expected"), [
    (0.0, [0, 1, 1, 0, 1, 1, 1, 1, 0]),
    (1.0, [0, 0.5, 0.5, 0, 0.25, 0.25, 0.25, 0.25, 0]),
    (0.5, [0, 0.75, 0.75, 0, 0.625, 0.625, 0.625, 0.625, 0]),
])
def test_turn_balance_weights_hand_case(progress, expected):
    spans = [(1, 3), (4, 8)]
    w = turn_balance_weights(spans, progress, length=9)
    assert w.tolist() == pytest.approx(expected)
    if progress == 1.0:  # every turn sums to 1
        assert [w[a:b].sum().item() for a, b in spans] == pytest.approx([1.0, 1.0])


def test_turn_balance_rejects_progress_outside_unit_interval():
    with pytest.raises(ValueError, match="progress"):
        turn_balance_weights([(0, 2)], 1.5, length=2)


def test_overlap_stop_hand_case():
    student = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    teacher = torch.tensor([[2, 1], [3, 9], [9, 9], [7, 8]])
    out = overlap_stop(student, teacher, threshold=0.6)
    assert out.overlap.tolist() == [1.0, 0.5, 0.0, 1.0]
    assert out.index.item() == 1
    assert out.weights.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.tokens_saved == 2
    # Position 1 is context (not counted): the first drift among action tokens is position 2
    masked = overlap_stop(student, teacher, 0.6, mask=torch.tensor([1, 0, 1, 1]), after_weight=0.1)
    assert masked.index.item() == 2
    assert masked.weights.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.1])
    assert masked.tokens_saved == 1
    none = overlap_stop(student, student, 0.6)
    assert none.index.item() == 4 and none.tokens_saved == 0 and none.weights.min() == 1.0


def test_overlap_stop_batched_rows_stop_independently():
    s = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 4]]])
    t = torch.tensor([[[1, 2], [8, 9]], [[8, 9], [3, 4]]])
    out = overlap_stop(s, t, threshold=0.5)
    assert out.index.tolist() == [1, 0]
    assert out.weights.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert out.tokens_saved == 1


def test_step_divergence_weights_hand_case():
    assert step_divergence_weights([0.0, LN(2)], alpha=1.0).tolist() == pytest.approx([1.0, 0.5])
    assert step_divergence_weights([0.0, LN(2)], alpha=2.0).tolist() == pytest.approx([1.0, 0.25])
    with pytest.raises(ValueError, match="per_turn_divergence"):
        step_divergence_weights([-1.0])


def test_spread_turn_values_puts_each_turn_weight_on_its_tokens():
    assert spread_turn_values([(0, 2), (3, 4)], [0.5, 2.0], length=5).tolist() == [0.5, 0.5, 0, 2.0, 0]


def test_informative_token_mask_hand_case():
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]])
    divergence = torch.tensor([[5.0] + [0.0] * 9])
    keep, frac = informative_token_mask(entropy, divergence, high_entropy_q=0.8, low_entropy_q=0.2,
                                        high_div_q=0.9)
    # quantiles: H_hi = 0.82, H_lo = 0.28, D_hi = 0.5: keep the two most uncertain tokens and the
    # confidently wrong first one; the confident token 1 agrees with the teacher and is dropped
    assert keep[0].nonzero().flatten().tolist() == [0, 8, 9]
    assert frac == pytest.approx(0.3)


def test_informative_token_mask_ignores_unmasked_tokens():
    entropy = torch.tensor([0.1, 0.9, 5.0])
    keep, frac = informative_token_mask(entropy, torch.zeros(3), mask=torch.tensor([1, 1, 0]),
                                        high_entropy_q=0.5, low_entropy_q=0.0, high_div_q=1.0)
    assert keep.tolist() == [True, True, False]  # low-entropy token 0 has the max divergence (0)
    assert frac == 1.0


# --------------------------------------------------------------------------- mixing and experts


def test_combine_and_linear_schedule():
    adv = combine_rl_and_distill(torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.5]), weight=2.0)
    assert adv.tolist() == [2.0, 0.0]
    assert linear_schedule(0, 1.0, 0.0, 10) == 1.0
    assert linear_schedule(5, 1.0, 0.0, 10) == pytest.approx(0.5)
    assert linear_schedule(50, 1.0, 0.0, 10) == 0.0


def test_expert_one_hot_teacher_hand_cases():
    assert expert_one_hot_teacher([5, 6, 7, 8], [5, 6, 9, 8]).tolist() == [0, 0, -10, -10]
    assert expert_one_hot_teacher([5, 6, 7, 8], [5, 6, 9, 8], prefix_only=False).tolist() == [0, 0, -10, 0]
    assert expert_one_hot_teacher([5, 6, 7], [5], floor=-5.0).tolist() == [0, -5, -5]
    with pytest.raises(ValueError, match="floor"):
        expert_one_hot_teacher([1], [1], floor=0.0)


# --------------------------------------------------------------------------- learning check


def test_reverse_kl_policy_gradient_moves_the_student_towards_the_teacher(tiny_model):
    """A few policy-gradient steps on the OPD advantage lower KL(student || teacher) on held-out prompts.

    The teacher is a fixed next-token distribution the student can express:
    logits along one random direction of the tied embedding. The student
    samples 4 tokens after each training prompt, the teacher scores them, and
    the reverse-KL advantage (minus its batch mean, a baseline) weights the
    student's log-probs. The exact full-vocabulary KL is measured on other prompts.
    """
    torch.manual_seed(0)
    model = copy.deepcopy(tiny_model).train()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    direction = torch.randn(model.config.hidden_size, generator=g)
    with torch.no_grad():
        emb = model.get_output_embeddings().weight.detach()
        teacher = torch.log_softmax(40.0 * (emb @ (direction / direction.norm())), dim=-1)
    train_prompts = torch.randint(3, vocab, (16, 6), generator=g)
    held_out = torch.randint(3, vocab, (16, 6), generator=g)

    def kl_to_teacher() -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=held_out).logits.float(), -1)
            return (logp.exp() * (logp - teacher)).sum(-1).mean().item()

    before = kl_to_teacher()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(10):
        ids = train_prompts
        with torch.no_grad():
            for _ in range(4):
                probs = torch.softmax(model(input_ids=ids, logits_to_keep=1).logits[:, -1].float(), -1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
        action = torch.zeros_like(ids, dtype=torch.bool)
        action[:, 6:] = True
        logprobs, _ = token_logprobs(model, ids, positions_to_keep=action)
        adv = reverse_kl_advantage(logprobs, teacher[ids])
        adv = (adv - adv[action].mean()) * action
        loss = -(adv * logprobs).sum() / action.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = kl_to_teacher()
    assert after < 0.75 * before, f"KL to the teacher went from {before:.4f} to {after:.4f}"


def test_forward_kl_on_a_one_token_support_with_teacher_log_prob_0_is_the_cross_entropy():
    from agentrl.train.distill import distribution_loss

    student = torch.log_softmax(torch.tensor([[[2.0, 0.5, -1.0]]]), -1)  # [1, 1, V]
    target = 1
    s_lp = student[..., target:target + 1].clone().requires_grad_(True)  # gathered at the support
    per, _ = distribution_loss(s_lp, torch.zeros(1, 1, 1), torch.ones(1, 1, 1, dtype=torch.bool),
                               torch.ones(1, 1), torch.ones(1, 1), "forward_kl")
    assert float(per.detach()) == pytest.approx(-float(student[0, 0, target]))
    per.sum().backward()
    assert float(s_lp.grad) == pytest.approx(-1.0)  # d(-log p)/d(log p)
