"""Constrained turns (``rollout.constrain: admissible``) are scored under the sampler's mask:
the trainer's log-probs of the sampled tokens are the sampler's, to 1e-5 on ``hf`` in fp32."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import pytest
import torch

from agentrl.config import load_config
from agentrl.models import load_model
from agentrl.policy import HFPolicy
from agentrl.rollout import Budget, Engine
from agentrl.rollout.allocators import Branch, Fresh
from agentrl.train import load_train_config, train
from agentrl.train.batch import constrain_samples, samples_from_credit, score_samples
from agentrl.train.logprobs import token_scores
from agentrl.types import EpisodeGroup


class Forks:
    """Two fresh episodes a task, then a turn branch and a segment fork of task 0's first episode."""

    name, needs_snapshots, top_logprobs = "forks", True, 0

    def plan(self, state):
        if state.round == 0:
            return [Fresh(t, 2) for t in range(2)]
        if state.round == 1:
            tree = state.trees[0]
            first = tree.nodes[tree.roots[0]]
            return [Branch(0, first.id, 2), Branch(0, first.children[0], 2, at_token=1)]
        return []


@pytest.fixture(scope="module", params=[1.0, 0.7], ids=["t1", "t0.7"])
def constrained(request, tokenizer, tiny_model):
    """Samples of constrained ALFWorld turns, and the sampler's per-token entropies."""
    cfg = load_config(overrides=["env.id=agentrl/ALFWorld-v0", "rollout.max_turns=3", "rollout.max_context_tokens=1024",
                                 "sampling.max_new_tokens=24", f"sampling.temperature={request.param}",
                                 "rollout.seed=4", "rollout.constrain=admissible"])
    engine = Engine(HFPolicy(tiny_model, tokenizer), cfg, "agentrl/ALFWorld-v0")
    try:
        trees = asyncio.run(engine.run([0, 1], Forks(), Budget(10)))
    finally:
        engine.close()
    groups = [EpisodeGroup.of(t) for t in trees]
    pairs = [(g.tree, ep) for g in groups for ep in g.episodes]
    samples = samples_from_credit([(ep, [0.0] * len(ep.input_ids)) for _, ep in pairs])
    assert constrain_samples(samples, tokenizer) == sum(s.n_action for s in samples) > 0
    assert any(n.partial for t in trees for n in t.nodes.values())  # a fork shares a turn's first token
    return samples, [_sampler_entropies(*p) for p in pairs], request.param


def _sampler_entropies(tree, episode):
    """The sampler's entropy of each action token, aligned with ``input_ids`` (0 elsewhere)."""
    out = [0.0] * len(episode.input_ids)
    for node, (start, end) in zip(episode.nodes, episode.turn_spans, strict=True):
        out[start:end] = [x for n in tree.turn_nodes(node.id) for x in n.entropies]
    return out


def _gaps(samples, scores, entropies):
    """The largest |trainer - sampler| over action tokens: of log-probs, and of entropies."""
    lp, ent = [], []
    for s, sc, e in zip(samples, scores, entropies, strict=True):
        lp += [abs(a - b) for a, b, m in zip(sc.logprobs, s.behaviour, s.mask, strict=True) if m]
        ent += [abs(a - b) for a, b, m in zip(sc.entropies, e, s.mask, strict=True) if m]
    return max(lp), max(ent)


@pytest.mark.parametrize("tree", [False, True], ids=["episode-rows", "tree-rows"])
def test_trained_logprobs_are_the_sampled_ones_under_the_mask(constrained, tiny_model, tokenizer, tree):
    samples, entropies, temperature = constrained
    scores, _ = score_samples(tiny_model, samples, 4096, tokenizer.pad_token_id, temperature, tree=tree)
    logprob_gap, entropy_gap = _gaps(samples, scores, entropies)
    assert logprob_gap < 1e-5
    assert entropy_gap < 1e-4


def test_without_the_mask_the_trainer_would_not_agree(constrained, tiny_model, tokenizer):
    samples, entropies, temperature = constrained
    free = [replace(s, allowed=None) for s in samples]
    scores, _ = score_samples(tiny_model, free, 4096, tokenizer.pad_token_id, temperature)
    assert min(_gaps(free, scores, entropies)) > 0.5  # the mass outside the allowed actions, in nats


def test_token_scores_masks_allowed_tokens_with_finite_gradients(tiny_model):
    ids = torch.tensor([[5, 17, 9, 30, 2]])
    allowed = torch.full((1, 5, 3), -1)
    allowed[0, 2] = torch.tensor([9, 11, -1])  # token 2 was sampled among {9, 11}
    allowed[0, 3] = torch.tensor([30, 2, 7])
    tiny_model.zero_grad()
    out = token_scores(tiny_model, ids, allowed=allowed)
    (out.logprobs.sum() + out.entropies.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in tiny_model.parameters() if p.grad is not None)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids).logits[0]
    for t, keep in ((2, [9, 11]), (3, [30, 2, 7])):
        logp = torch.log_softmax(logits[t - 1, keep], -1)
        assert abs(out.logprobs[0, t].item() - logp[keep.index(int(ids[0, t]))].item()) < 1e-5
        assert abs(out.entropies[0, t].item() + (logp.exp() * logp).sum().item()) < 1e-5
    free = torch.log_softmax(logits[3], -1)[30]  # an unconstrained token: the whole vocabulary
    assert abs(out.logprobs[0, 4].item() - torch.log_softmax(logits[3], -1)[2].item()) < 1e-5
    assert abs(out.logprobs[0, 3].item() - free.item()) > 0.1
    tiny_model.zero_grad()


@pytest.mark.parametrize("layout", [["train.loss.kl_coef=0.01", "train.loss.entropy_coef=0.01"],
                                    ["train.tree_packing=true"]], ids=["kl", "tree"])
def test_a_constrained_training_step_sees_no_sampler_trainer_mismatch(tmp_path, layout):
    """A whole RL step on ALFWorld under the constraint: the scoring pass (two epochs) agrees
    with the sampler, as unconstrained runs do, and the KL reference or tree rows score too."""
    cfg = load_train_config(None, [
        "policy.model=tiny-random", "env.id=agentrl/ALFWorld-v0", "rollout.constrain=admissible",
        "rollout.max_turns=2", "rollout.group_size=2", "rollout.max_context_tokens=1024",
        "sampling.max_new_tokens=24", "sampling.temperature=1.0", "train.tasks_per_step=2",
        "train.minibatch_size=2", "train.epochs=2", "train.steps=1", "train.evaluation.every=0",
        "train.evaluation.episodes=0", "train.micro_batch_tokens=4096", "train.output.tensorboard=false",
        "train.checkpointing.export_hf=false", "train.output.plot=false", "train.skip_zero_advantage=false",
        f"train.output.dir={tmp_path}", *layout])
    train(cfg, policy=HFPolicy(*load_model("tiny-random")), progress=False)
    row = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if json.loads(x).get("phase") == "rl"][-1]
    assert row["train/constrained_tokens"] > 0 and row["train/scoring_pass"] == 1
    assert row["mismatch/max_abs_dlogprob"] < 1e-4
    assert all(math.isfinite(v) for k, v in row.items() if k.startswith("loss/"))
