"""The turn-level value head for GAE: ridge fits by hand, and the loop uses, refits and checkpoints it."""

from __future__ import annotations

import pytest
import torch

from agentrl.train.config import TrainConfig, load_train_config
from agentrl.train.metrics import ProgressBars
from agentrl.train.trainer import Trainer
from agentrl.train.value import ValueHead, ValueHeadConfig, next_context, ridge_fit, turn_features
from agentrl.types import Episode, Node
from tests.train.test_opd_training import GUESS


def test_ridge_fit_solves_least_squares_with_an_unpenalised_bias():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w = ridge_fit(x, torch.tensor([1.0, 2.0, 3.0]), l2=0.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.0], abs=1e-5)
    # A huge penalty shrinks the weights to 0; the bias becomes the mean target.
    w = ridge_fit(x, torch.tensor([1.0, 2.0, 3.0]), l2=1e9)
    assert w[:2].abs().max() < 1e-6 and float(w[2]) == pytest.approx(2.0, abs=1e-5)


def test_the_head_fits_lambda_returns_by_hand():
    ep = Episode.from_path([Node(context_ids=[1, 2], action_ids=[3], reward=0.0),
                            Node(context_ids=[4], action_ids=[5], reward=1.0, terminated=True)])
    head = ValueHead(1, ValueHeadConfig(l2=0.0, mix=1.0))
    features = [torch.tensor([[1.0], [0.0]])]  # turn 1's state, turn 2's state
    stats = head.fit(features, [ep], gamma=0.5, lam=1.0)
    # V = 0 before: targets are the returns [0.5, 1]; w . [h, 1]: -0.5 * 1 + 1 = 0.5, 0 + 1 = 1.
    assert head.w.tolist() == pytest.approx([-0.5, 1.0], abs=1e-5)
    assert stats["value/mse_before"] == pytest.approx((0.25 + 1.0) / 2)
    assert stats["value/mse_after"] == pytest.approx(0.0, abs=1e-9) and stats["value/explained_var"] == pytest.approx(1.0)
    half = ValueHead(1, ValueHeadConfig(l2=0.0, mix=0.5))
    half.fit(features, [ep], gamma=0.5, lam=1.0)
    assert half.w.tolist() == pytest.approx([-0.25, 0.5], abs=1e-5)  # half way from 0


def test_the_bootstrap_row_moves_the_targets_but_is_not_fitted():
    cut = Node(context_ids=[4], action_ids=[5], reward=0.0, truncated=True, info={"next_context_ids": [6]})
    ep = Episode.from_path([Node(context_ids=[1, 2], action_ids=[3], reward=0.0), cut])
    assert next_context(ep) == [6]
    head = ValueHead(1, ValueHeadConfig(l2=0.0, mix=1.0))
    head.w = torch.tensor([1.0, 0.0])  # V(h) = h
    features = [torch.tensor([[1.0], [0.0], [2.0]])]  # two turns' states, then the state after the cut
    stats = head.fit(features, [ep], gamma=0.5, lam=1.0)
    # V = [1, 0], bootstrap 2: delta1 = 0 + 0.5 * 2 - 0 = 1, delta0 = 0 + 0.5 * 0 - 1 = -1,
    # A = [-1 + 0.5 * 1, 1] = [-0.5, 1]; targets A + V = [0.5, 1]; fit on the two turns: -0.5 h + 1.
    assert stats["value/turns"] == 2
    assert head.w.tolist() == pytest.approx([-0.5, 1.0], abs=1e-5)
    ended = Episode.from_path([Node(context_ids=[1], action_ids=[3], terminated=True, info={"next_context_ids": [6]})])
    assert next_context(ended) == []  # an episode the env ended has no state after it


def test_a_cut_episode_keeps_the_context_its_next_turn_would_have_read(tmp_path):
    torch.set_num_threads(1)
    cfg = load_train_config(None, GUESS + [
        "env.kwargs={high: 16, max_turns: 6}", "rollout.max_turns=2", "rollout.group_size=2",
        "train.tasks_per_step=2", "train.credit=gae", "train.value_head={}", f"train.output.dir={tmp_path}"])
    tr = Trainer(cfg, progress=False)
    assert tr.cfg.rollout.record_next_context  # the trainer asks the engine for it
    bars = ProgressBars(tr.console, False)
    short, _ = tr.rollout(0, bars)
    tr.cfg.rollout.max_turns = 3  # the same step again, one turn further: the same first two turns
    longer, _ = tr.rollout(0, bars)
    cut = 0
    for s_tree, l_tree in zip(short, longer, strict=True):
        for s, lg in zip(s_tree.episodes(), l_tree.episodes(), strict=True):
            if s.nodes[-1].info.get("truncation_reason") != "max_turns=2" or lg.num_turns < 3:
                continue
            # Batches form by timing, so float noise can flip a near-tie between the two runs.
            if [n.action_ids for n in s.nodes] != [n.action_ids for n in lg.nodes[:2]]:
                continue
            cut += 1
            assert next_context(s) == lg.nodes[2].context_ids  # token-exact: what turn 3 read
            f_short, f_long = turn_features(tr.learner.net, s), turn_features(tr.learner.net, lg)
            assert f_short.shape[0] == 3  # two turns, then the bootstrap state
            torch.testing.assert_close(f_short, f_long[:3], atol=1e-5, rtol=1e-4)
    assert cut > 0


def test_value_head_needs_gae():
    with pytest.raises(ValueError, match="value_head is read by credit: 'gae' only"):
        TrainConfig(credit="grpo", value_head={})
    assert TrainConfig(credit="gae", value_head={"mix": 0.3}).value_head.mix == 0.3


def test_gae_with_the_head_trains_refits_and_resumes(tmp_path):
    torch.set_num_threads(1)
    cfg = load_train_config(None, GUESS + [
        "rollout.group_size=4", "train.tasks_per_step=2", "train.steps=2", "train.minibatch_size=8",
        "train.credit={name: gae, gamma: 0.9, lam: 0.95}", "train.value_head={mix: 1.0}",
        f"train.output.dir={tmp_path}"])
    tr = Trainer(cfg, progress=False)
    bars = ProgressBars(tr.console, False)
    trees, _ = tr.rollout(0, bars)
    for ep in trees[0].episodes():  # the untrained model wins nothing: give one group some reward
        ep.nodes[-1].reward = 1.0
        break
    stats = tr.learner.learn(trees, 0, bars.start)
    turns = sum(ep.num_turns for t in trees for ep in t.episodes())
    assert stats["value/turns"] == turns and tr.learner.value_head.w.abs().sum() > 0
    assert stats["value/mse_after"] <= stats["value/mse_before"]  # a least-squares fit of the same targets
    tr.step = 1
    tr.save()
    again = Trainer(cfg, progress=False)
    assert again.resume() and torch.equal(again.learner.value_head.w, tr.learner.value_head.w)


def test_the_next_context_is_kept_only_when_that_turn_could_have_run():
    from agentrl.rollout.turns import record_next_context

    class Ctx:
        def __init__(self, length, error=None):
            self.length, self.error = length, error

        def __len__(self):
            return self.length

        def observation_ids(self, messages):
            if self.error:
                raise self.error
            return [7, 8, 9]

    kept, full, broken = Node(), Node(), Node()
    record_next_context(kept, Ctx(12), [], max_context_tokens=16)  # 12 + 3 < 16: turn 3 fits
    record_next_context(full, Ctx(13), [], max_context_tokens=16)  # 13 + 3 = 16: no room to act
    record_next_context(broken, Ctx(1, ValueError("bad template")), [], max_context_tokens=16)
    assert kept.info == {"next_context_ids": [7, 8, 9]}
    assert full.info == {}
    assert broken.info == {"next_context_error": "ValueError: bad template"}
