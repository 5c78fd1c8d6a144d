"""Distribution-level distillation pieces: top-k scores, the support, the loss term, the overlap stop."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.train.batch import DistillFields, Sample
from agentrl.train.config import load_train_config
from agentrl.train.distill import (
    DistillConfig,
    add_distill_advantages,
    build_support,
    distribution_loss,
    document_bos,
    overlap_weights,
)
from agentrl.train.logprobs import token_scores
from agentrl.train.metrics import ProgressBars
from agentrl.types import read_trees
from tests.train.test_opd_training import GUESS, distill_trainer, first_step


def test_token_scores_gather_candidates_and_top_k_from_the_full_distribution(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (2, 7))
    cand = torch.randint(0, 1000, (2, 7, 3))
    cand[0, 2, 1] = -1  # no candidate there: its value is not read
    with torch.no_grad():
        out = token_scores(tiny_model, ids, temperature=0.7, candidates=cand, top_k=4)
    with torch.no_grad():
        full = torch.log_softmax(tiny_model(ids).logits.float() / 0.7, -1)  # [B, T, V], predicts t + 1
    for b in range(2):
        for t in range(1, 7):
            assert out.logprobs[b, t] == pytest.approx(float(full[b, t - 1, ids[b, t]]), abs=1e-5)
            want = full[b, t - 1, cand[b, t].clamp(min=0)]
            assert torch.allclose(out.candidates[b, t], want, atol=1e-5)
            top = torch.topk(full[b, t - 1], 4)
            assert out.top_ids[b, t].tolist() == top.indices.tolist()
            assert torch.allclose(out.top_logprobs[b, t], top.values, atol=1e-5)
    assert out.top_ids[:, 0].eq(-1).all() and out.candidates[:, 0].eq(0).all()  # no source position


def test_the_support_takes_both_top_ks_once_and_leaves_special_tokens_out():
    ids, lp = build_support(torch.tensor([[5, 3]]), torch.tensor([[-1.0, -2.0]]),
                            torch.tensor([[3, 7]]), torch.tensor([[-0.5, -0.75]]),
                            both=True, special=torch.tensor([7]))
    assert ids.tolist() == [[5, 3, -1, -1]]  # 3 is the student's already; 7 is special
    assert lp.tolist() == [[-1.0, -2.0, -0.5, -0.75]]
    ids, lp = build_support(torch.tensor([[5, 3]]), torch.tensor([[-1.0, -2.0]]),
                            torch.tensor([[3, 7]]), torch.tensor([[-0.5, -0.75]]), both=False)
    assert ids.tolist() == [[5, 3]] and lp.tolist() == [[-1.0, -2.0]]
    ids, _ = build_support(torch.tensor([[5, 3]]), torch.tensor([[-1.0, -2.0]]),
                           torch.tensor([[3, 7]]), torch.tensor([[-0.5, -0.75]]), both=True, vocab=6)
    assert ids.tolist() == [[5, 3, -1, -1]]  # 7 is past the student's vocabulary (a bigger teacher head)


def test_the_support_leaves_out_ids_a_constrained_token_was_not_allowed():
    # token 1 was sampled among {5, 9} (rollout.constrain): its top-3 under the mask lists 3 at -inf
    ids, lp = build_support(torch.tensor([[5, 3, 9], [5, 3, 9]]), torch.tensor([[-1.0, -2.0, -3.0]] * 2),
                            torch.tensor([[9, 4], [9, 4]]), torch.tensor([[-0.5, -0.75]] * 2),
                            both=True, allowed={1: [5, 9]})
    assert ids.tolist() == [[5, 3, 9, -1, 4], [5, -1, 9, -1, -1]]  # token 0 is free: 3 and 4 stay
    assert lp.tolist() == [[-1.0, -2.0, -3.0, -0.5, -0.75]] * 2


@pytest.mark.parametrize("signal", ["topk_reverse_kl", "jsd", "lsm"])
def test_a_distribution_signal_trains_constrained_turns_with_finite_weights(tmp_path, signal):
    """Constrained ALFWorld turns force most tokens (one allowed id), so a top-4 under the mask
    lists ids of probability 0 on both sides: they left the weights NaN after one step."""
    from agentrl.models import load_model
    from agentrl.policy.hf import HFPolicy
    from agentrl.train import train

    torch.set_num_threads(1)
    cfg = load_train_config(None, [
        "policy.model=tiny-random", "env.id=agentrl/ALFWorld-v0", "rollout.constrain=admissible",
        "rollout.max_turns=2", "rollout.group_size=2", "rollout.max_context_tokens=1024",
        "sampling.max_new_tokens=24", "sampling.temperature=1.0", "train.tasks_per_step=2",
        "train.minibatch_size=4", "train.steps=1", "train.evaluation.episodes=0",
        "train.output.tensorboard=false", "train.checkpointing.export_hf=false", "train.output.plot=false",
        "train.skip_zero_advantage=false", f"train.distill={{teacher: tiny-random, signal: {signal}, top_k: 4}}",
        f"train.output.dir={tmp_path}"])
    policy = HFPolicy(*load_model("tiny-random"))
    train(cfg, policy=policy, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"][-1]
    assert rl["train/constrained_tokens"] > 0, "no constrained token: the test would not test the mask"
    assert math.isfinite(rl["loss/total"]) and math.isfinite(rl["grad/norm"])
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())


def test_the_loss_term_by_hand_with_a_left_out_candidate_and_a_masked_token():
    ps, pt = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.25, 0.5, 0.25])
    teacher = pt.log().repeat(1, 2, 1)  # [B=1, T=2, C=3]
    keep = torch.tensor([[[True, True, False]] * 2])  # the third candidate is left out
    weights, mask = torch.tensor([[2.0, 5.0]]), torch.tensor([[True, False]])
    kept_s, kept_t = ps[:2], pt[:2]
    m = 0.5 * kept_s + 0.5 * kept_t
    want = {
        "topk_reverse_kl": float((kept_s * (kept_s / kept_t).log()).sum()),
        "forward_kl": float((kept_t * (kept_t / kept_s).log()).sum()),
        "jsd": float(0.5 * (kept_t * (kept_t / m).log()).sum() + 0.5 * (kept_s * (kept_s / m).log()).sum()),
        # both renormalised on the two kept ids: KL([5/8, 3/8] || [1/3, 2/3])
        "lsm": float((torch.tensor([5 / 8, 3 / 8]) * (torch.tensor([5 / 8, 3 / 8]) / torch.tensor([1 / 3, 2 / 3])).log()).sum()),
    }
    for signal, value in want.items():
        student = ps.log().repeat(1, 2, 1).requires_grad_(True)
        per, stats = distribution_loss(student, teacher, keep, weights, mask, signal)
        assert stats[f"loss/distill_{signal}"] == pytest.approx(value, abs=1e-6), signal
        assert per.detach()[0].tolist() == pytest.approx([2.0 * value, 0.0], abs=1e-6)  # token 2 is masked
        per.sum().backward()
        assert torch.isfinite(student.grad).all() and student.grad[0, 1].eq(0).all()
        assert student.grad[0, 0, 2] == 0, signal  # no gradient to a left-out candidate


def test_the_policy_loss_aggregates_an_extra_term_over_its_kept_tokens():
    from agentrl.train.loss import PolicyLossConfig, policy_loss

    lp = torch.zeros(1, 3)
    extra = torch.tensor([[1.0, 2.0, 3.0]])
    versions = torch.tensor([[5, 5, 1]])  # the last token is 4 versions stale
    loss, stats = policy_loss(lp, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool),
                              PolicyLossConfig(max_token_staleness=2), versions=versions, current_version=5,
                              extra_per_token=extra)
    assert stats["loss/extra"] == pytest.approx(1.5) and float(loss) == pytest.approx(1.5)


def test_a_bos_is_cut_only_where_it_opens_the_document_once(tokenizer):
    assert document_bos(tokenizer) is None  # SmolLM2's "BOS" is <|im_start|>, which opens every turn

    class RealBos:
        bos_token_id = 9

        def apply_chat_template(self, messages, tokenize=True):
            return [9] + [t for i, _ in enumerate(messages) for t in (5, 6 + i)]

    assert document_bos(RealBos()) == 9


def test_options_that_would_do_nothing_are_refused():
    for bad in ({"jsd_beta": 0.3}, {"top_k": 4}, {"overlap_after_weight": 0.5},
                {"signal": "lsm", "top_k": 1}, {"signal": "jsd", "mask_special": False, "overlap_after_weight": 0.1}):
        with pytest.raises(ValueError, match="train.distill"):
            DistillConfig(teacher="x", **bad)
    assert DistillConfig(teacher="x", signal="jsd", jsd_beta=0.3, top_k=4).top_k == 4
    # A saved config writes every default out; it must load back.
    for cfg in (DistillConfig(teacher="x"), DistillConfig(teacher="x", signal="jsd", jsd_beta=0.3)):
        assert DistillConfig(**cfg.model_dump()) == cfg
    full = load_train_config(None, GUESS + ["train.distill={teacher: tiny-random, signal: lsm}"])
    assert type(full).model_validate(full.model_dump(mode="json")) == full
    assert DistillConfig(teacher="x", overlap_threshold=0.5, overlap_after_weight=0.5, top_k=4).top_k == 4


def test_the_overlap_stop_down_weights_what_follows_the_first_drift():
    s = Sample(input_ids=[1] * 5, mask=[0, 1, 1, 1, 1], behaviour=[0.0] * 5, advantages=[0.0] * 5,
               versions=[0] * 5,
               old_top=[[-1, -1], [4, 5], [6, 7], [8, 9], [1, 2]],
               distill=DistillFields(teacher_top=[[-1, -1], [5, 4], [6, 1], [3, 0], [1, 2]]))  # overlap 1, .5, 0, 1
    [w], stats = overlap_weights([s], threshold=0.5, after_weight=0.25)
    assert w.tolist() == [1.0, 1.0, 1.0, 1.0, 0.25]  # drift at position 3, so only position 4 is after it
    assert stats["distill/overlap_mean"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert stats["distill/overlap_stopped_frac"] == 1 and stats["distill/overlap_tokens_after_stop"] == 1
    # The weights reach the sampled-token signal: after the stop it counts a quarter.
    s.old, s.distill.teacher = [0.0, -1.0, -1.0, -1.0, -1.0], [0.0, -0.5, -0.5, -0.5, -0.5]
    add_distill_advantages([s], weight=1.0, token_weights=[w])
    assert s.advantages == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.125])


def test_distribution_signals_refuse_what_cannot_carry_them(tmp_path):
    with pytest.raises(ValueError, match="one-hot"):
        DistillConfig(teacher="expert", signal="lsm")
    assert DistillConfig(teacher="expert", signal="forward_kl").signal == "forward_kl"  # DAgger
    with pytest.raises(ConfigError, match="tree_packing"):
        load_train_config(None, GUESS + ["train.distill={teacher: tiny-random, signal: lsm}",
                                         "train.tree_packing=true", f"train.output.dir={tmp_path}"])


def test_a_privileged_self_teacher_with_a_top_k_signal_and_the_overlap_stop(tmp_path):
    tr = distill_trainer(tmp_path, "{teacher: self, privileged: true, signal: jsd, top_k: 4, "
                                   "overlap_threshold: 0.5}")
    _, stats = first_step(tr)
    assert stats["loss/distill_jsd"] > 0  # the secret changes the teacher's distribution
    assert 0 < stats["distill/overlap_mean"] <= 1 and stats["train/optimizer_steps"] == 1


def test_a_vllm_teacher_takes_only_the_sampled_token_signal():
    assert DistillConfig(teacher="vllm:smollm2-135m").teacher == "vllm:smollm2-135m"
    engine = {"gpu_memory_utilization": 0.3}
    assert DistillConfig(teacher="vllm:smollm2-135m", teacher_engine=engine).teacher_engine == engine
    with pytest.raises(ValueError, match="teacher_engine"):
        DistillConfig(teacher="tiny-random", teacher_engine=engine)
    with pytest.raises(ValueError, match="max_model_len"):
        DistillConfig(teacher="vllm:smollm2-135m", teacher_engine={"max_model_len": 512})
    for bad in ({"signal": "lsm"}, {"overlap_threshold": 0.5}, {"teacher_temperature": 0.5}):
        with pytest.raises(ValueError, match="vllm"):
            DistillConfig(teacher="vllm:smollm2-135m", **bad)


def test_the_depth_budget_keeps_the_turns_that_hold_the_divergence():
    from agentrl.train.distill import depth_budget

    assert depth_budget([5.0, 3.0, 1.0, 1.0], coverage=0.8) == 2  # 5 + 3 = 8 of 10
    assert depth_budget([5.0, 3.0, 1.0, 1.0], coverage=0.81) == 3
    assert depth_budget([5.0, 3.0, 1.0, 1.0], coverage=1.0) == 4
    assert depth_budget([5.0, 3.0], coverage=0.1, min_turns=2) == 2
    assert depth_budget([0.0, 0.0, 0.0], coverage=0.5) == 3  # nothing measured yet: no cut
    with pytest.raises(ValueError, match="coverage"):
        depth_budget([1.0], coverage=0.0)


def test_the_depth_budget_caps_the_next_steps_rollouts(tmp_path):
    tr = distill_trainer(tmp_path, "{teacher: tiny-random, depth_coverage: 0.3}", steps=2)
    tr.learner.net.model.layers[0].mlp.down_proj.weight.data.mul_(3.0)  # the student drifts from its own copy
    _, stats = first_step(tr)
    budget = stats["distill/depth_budget"]
    assert budget == tr.learner.distiller.depth_budget and 1 <= budget < 3
    assert len(tr.learner.distiller.turn_mass) >= 2 and tr.learner.distiller.turn_mass[0] > 0
    tr.step = 1
    tr._one_step(ProgressBars(tr.console, False))  # step 2 rolls out under the budget step 1 left
    trees = read_trees(tmp_path / "trees" / "step-000002.jsonl")
    assert max(len(ep.nodes) for t in trees for ep in t.episodes()) <= budget
    budget = tr.learner.distiller.depth_budget
    tr.save()
    again = distill_trainer(tmp_path, "{teacher: tiny-random, depth_coverage: 0.3}", steps=2)
    assert again.resume() and again.learner.distiller.depth_budget == budget  # the statistics are checkpointed
    assert again.learner.distiller.turn_mass == pytest.approx(tr.learner.distiller.turn_mass)
