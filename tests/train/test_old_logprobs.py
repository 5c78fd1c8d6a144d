"""train.old_logprobs=sampler: PPO anchored to the sampler's log-probs, with no scoring pass.

On the hf backend in fp32 the sampler computes what the trainer computes, so a step
anchored to the sampler must land where the rescored step lands; and where the
sampler's numbers mean something else, the option is refused naming why.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import agentrl.train.batch as batch_module
from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config
from agentrl.train.trainer import Trainer, _not_an_fp32_hf_sampler

GUESS = ["policy.model=tiny-random", "policy.backend=hf", "env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 4, max_turns: 3}",
         "rollout.max_turns=3", "rollout.max_context_tokens=256", "sampling.max_new_tokens=3",
         "sampling.temperature=0.7", "train.micro_batch_tokens=2048", "train.evaluation.episodes=0",
         "train.output.tensorboard=false", "train.output.plot=false", "train.checkpointing.export_hf=false",
         "train.tasks_per_step=2", "rollout.group_size=4", "train.steps=1", "train.minibatch_size=4",
         "train.optimizer.lr=1e-3", "train.precision=fp32",
         "train.skip_zero_advantage=false"]


def one_step(tmp_path, monkeypatch, mode: str) -> tuple[dict[str, torch.Tensor], dict, list[tuple]]:
    """The weights after one step, its logged stats, and (old, behaviour, mask) as each loss row read them."""
    torch.set_num_threads(1)
    tr = Trainer(load_train_config(None, GUESS + [f"train.output.dir={tmp_path / mode}",
                                                  f"train.old_logprobs={mode}"]), progress=False)
    rows: list[tuple] = []
    row_loss = batch_module.row_loss
    credit = tr.learner._credit

    def signed_credit(groups: list) -> tuple:  # the tiny random model never wins: give it +-1 advantages
        samples, credited, stats = credit(groups)
        for i, s in enumerate(samples):
            s.advantages = [(1.0 if i % 2 else -1.0) * m for m in s.mask]
        return samples, credited, stats

    tr.learner._credit = signed_credit

    def spy(logprobs: torch.Tensor, entropies: torch.Tensor, row: Any, spec: Any) -> Any:
        v = row.values
        if "old" in v:
            rows.append((v["old"].detach().clone(), v["behaviour"].detach().clone(), row.mask.clone()))
        return row_loss(logprobs, entropies, row, spec)

    monkeypatch.setattr(batch_module, "row_loss", spy)
    tr.run()
    weights = {k: p.detach().clone() for k, p in tr.learner.model.named_parameters()}
    import json
    lines = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    stats = [x for x in lines if x.get("phase") == "rl"][-1]
    return weights, stats, rows


def test_anchoring_to_the_sampler_lands_where_the_rescored_update_lands(tmp_path, monkeypatch):
    w0 = {k: p.detach().clone() for k, p in Trainer(load_train_config(None, GUESS + [
        f"train.output.dir={tmp_path / 'init'}"]), progress=False).learner.model.named_parameters()}
    w_rescore, st_rescore, rows_rescore = one_step(tmp_path, monkeypatch, "rescore")
    w_sampler, st_sampler, rows_sampler = one_step(tmp_path, monkeypatch, "sampler")
    assert st_rescore["train/scoring_pass"] == 1 and st_sampler["train/scoring_pass"] == 0
    assert "mismatch/kl" in st_rescore  # not measurable without the pass: no 0 that looks like a measurement
    assert not [k for k in st_sampler if k.startswith(("mismatch/", "tis/"))] and "tis/on" in st_rescore
    # sampler: the anchor the loss read is exactly the behaviour log-probs
    assert rows_sampler and all(torch.equal(old[m.bool()], beh[m.bool()]) for old, beh, m in rows_sampler)
    # rescore: the anchor is the trainer's own pass, within fp32 noise of the sampler's numbers
    gaps = [float((old - beh)[m.bool()].abs().max()) for old, beh, m in rows_rescore]
    assert rows_rescore and max(gaps) < 1e-4, gaps
    moved = max(float((w_rescore[k] - w0[k]).abs().max()) for k in w0)
    apart = max(float((w_rescore[k] - w_sampler[k]).abs().max()) for k in w0)
    assert moved > 1e-4 and apart < moved / 100, (moved, apart)


@pytest.mark.parametrize("sets, why", [
    (["sampling.top_p=0.9"], "truncated distribution"),
    (["sampling.top_k=20"], "truncated distribution"),
    (["policy.backend=vllm"], "the hf backend in float32"),
    (["policy.dtype=bfloat16"], "the hf backend in float32"),
    (["train.precision=bf16"], "train.precision=bf16"),
    (["train.asynchronous={max_batch_staleness: 1}"], "train.asynchronous"),
    (["train.distill={teacher: expert}"], "train.distill"),
    (["policy.backend=auto", "distributed={num_rollout_workers: 1}"], "each worker resolves the backend"),
])
def test_sampler_anchor_is_refused_where_the_sampler_s_numbers_mean_something_else(sets, why):
    with pytest.raises(ConfigError, match=rf"train\.old_logprobs=sampler is refused with .*{why}"):
        load_train_config(None, GUESS + ["train.old_logprobs=sampler", *sets])
    load_train_config(None, GUESS + ["train.old_logprobs=rescore", *sets])  # the default takes any of them


def test_sampler_anchor_is_refused_where_auto_precision_resolves_to_bf16(tmp_path, monkeypatch):
    """precision auto is bf16 on a CPU with native bf16: the config cannot know, the trainer can."""
    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    cfg = load_train_config(None, GUESS + ["train.precision=auto", "train.old_logprobs=sampler",
                                           f"train.output.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"train\.old_logprobs=sampler anchors .* to 'bf16'.*; use rescore or auto"):
        Trainer(cfg, progress=False)
    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    Trainer(cfg, progress=False).close()


@pytest.mark.parametrize("bf16, sets, chosen", [
    ("0", [], "sampler"),
    ("1", [], "rescore"),  # auto precision is bf16 on a CPU with native bf16
    ("0", ["sampling.top_p=0.9"], "rescore"),
    ("0", ["train.distill={teacher: expert}"], "rescore"),
    ("0", ["train.asynchronous={max_batch_staleness: 1}"], "rescore"),
])
def test_auto_anchors_to_the_sampler_only_where_it_computes_what_the_trainer_does(
        tmp_path, monkeypatch, capsys, bf16, sets, chosen):
    from rich.console import Console

    monkeypatch.setenv("AGENTRL_CPU_BF16", bf16)
    cfg = load_train_config(None, GUESS + ["train.precision=auto", "train.old_logprobs=auto",
                                           f"train.output.dir={tmp_path}", *sets])
    tr = Trainer(cfg, progress=False, console=Console(width=400))
    try:
        assert tr.cfg.train.old_logprobs == chosen and tr.learner.cfg.train.old_logprobs == chosen
        assert cfg.train.old_logprobs == "auto"  # the caller's config is not changed
    finally:
        tr.close()
    printed = capsys.readouterr().out
    assert f"train.old_logprobs auto: {chosen}" in printed
    if chosen == "rescore":  # and says why
        assert "because of" in printed


def test_auto_runs_a_step_without_the_scoring_pass_where_it_chose_the_sampler(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    tr = Trainer(load_train_config(None, GUESS + ["train.precision=auto", "train.old_logprobs=auto",
                                                  f"train.output.dir={tmp_path}"]), progress=False)
    tr.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    row = [x for x in lines if x.get("phase") == "rl"][-1]
    assert row["train/scoring_pass"] == 0 and not [k for k in row if k.startswith("mismatch/")]


def test_auto_follows_the_policy_given_to_the_trainer_not_only_the_config(tmp_path, monkeypatch):
    """A policy passed in need not be what ``policy`` says: one sampling in bf16 gets rescore
    from auto, and an explicit sampler is refused, naming the policy's dtype."""
    from agentrl.models import load_model
    from agentrl.policy.hf import HFPolicy

    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    model, tokenizer = load_model("tiny-random")
    bf16 = HFPolicy(model.to(torch.bfloat16), tokenizer)
    cfg = load_train_config(None, GUESS + ["train.precision=auto", "train.old_logprobs=auto",
                                           f"train.output.dir={tmp_path}"])
    tr = Trainer(cfg, policy=bf16, progress=False)
    try:
        assert tr.cfg.train.old_logprobs == "rescore" and tr.learner.cfg.train.old_logprobs == "rescore"
    finally:
        tr.close()
    explicit = load_train_config(None, GUESS + ["train.old_logprobs=sampler", f"train.output.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"the policy given to the trainer samples in \['torch\.bfloat16'\]"):
        Trainer(explicit, policy=bf16, progress=False)
    fp32 = HFPolicy(*load_model("tiny-random"))
    tr = Trainer(cfg, policy=fp32, progress=False)
    try:
        assert tr.cfg.train.old_logprobs == "sampler"
    finally:
        tr.close()
    from agentrl.policy.mock import MockPolicy

    assert _not_an_fp32_hf_sampler(object.__new__(MockPolicy)) == "is a MockPolicy, not the hf backend"
    remote = type("RayPolicy", (), {"__module__": "agentrl.distributed.rollout_workers"})()
    assert _not_an_fp32_hf_sampler(remote) is None  # a rollout worker's: the config's checks cover it



def _wide_random_model() -> torch.nn.Module:
    """A random Llama wide enough (hidden 256) that bf16 rounds a token's score by the row it is in;
    the tiny-random model's sums are too short to show it."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("aligned", [True, False])
def test_in_bf16_old_logprobs_packed_as_the_update_s_minibatches_give_a_ratio_of_exactly_1(aligned):
    """The update at lr 0 (its weights never move) reads old log-probs from a scoring pass that
    packed the epoch's minibatches as the update does: every ratio is exactly 1 (approx_kl 0).
    Packed as one batch, as the pass did before, bf16 rounds them apart (measured on SmolLM2-135M
    in make run's rows: approx_kl 1.0e-4)."""
    from agentrl.train.batch import (
        Sample,
        minibatches,
        score_old,
        shuffled_orders,
        train_on_samples,
    )
    from agentrl.train.loss import PolicyLossConfig, StepLoss
    from agentrl.train.model import precision

    torch.set_num_threads(1)
    model = _wide_random_model()
    g = torch.Generator().manual_seed(1)
    samples = []
    for k, n in enumerate((40, 73, 55, 90, 31, 64, 80, 47)):
        ids = torch.randint(5, 2000, (n,), generator=g).tolist()
        samples.append(Sample(ids, [0] * 10 + [1] * (n - 10), [0.0] * n, [0.0] * 10 + [(-1.0) ** k] * (n - 10),
                              [0] * n))
    orders = shuffled_orders(len(samples), 2, torch.Generator().manual_seed(0))
    with precision("bf16"):
        score_old(model, samples, 2048, 0, 1.0, groups=minibatches(orders[0], 2) if aligned else None)
        for s in samples:
            s.behaviour = list(s.old)
        st = train_on_samples(model, torch.optim.SGD(model.parameters(), lr=0.0), None, samples,
                              StepLoss(PolicyLossConfig(), version=0), fields=("advantages", "behaviour", "versions",
                                                                               "old"),
                              epochs=1, minibatch_size=2, max_tokens=2048, max_grad_norm=None, per_token=True,
                              pad_id=0, temperature=1.0, orders=orders[:1])
    assert st["train/optimizer_steps"] == 4
    if aligned:
        assert st["ppo/approx_kl"] == 0.0 and st["ppo/ratio_mean"] == 1.0
    else:
        assert st["ppo/approx_kl"] > 1e-9


@pytest.mark.parametrize("tree", [False, True])
def test_in_bf16_the_first_minibatch_anchored_to_its_own_forward_trains_as_the_full_pass_does(tree):
    """anchor_first: the first minibatch is left out of the scoring pass and fills ``Sample.old``
    from the update's own forward. In bf16 those are the numbers the full pass gives, bit for bit,
    and two epochs of updates (the second reads them as the anchor) land on the same weights."""
    import copy

    from agentrl.train.batch import (
        Sample,
        minibatches,
        score_old,
        shuffled_orders,
        train_on_samples,
    )
    from agentrl.train.loss import PolicyLossConfig, StepLoss
    from agentrl.train.model import precision

    torch.set_num_threads(1)
    model = _wide_random_model()
    models = [model, copy.deepcopy(model)]
    g = torch.Generator().manual_seed(2)
    base = []
    for k, n in enumerate((40, 73, 55, 90, 31, 64, 80)):
        # a prefix the tree rows share, its last 2 tokens actions (the mask starts at 10)
        ids = list(range(1, 13)) + torch.randint(13, 2000, (n - 12,), generator=g).tolist()
        beh = (-torch.rand(n, generator=g) * 8).tolist()
        base.append(Sample(ids, [0] * 10 + [1] * (n - 10), beh, [0.0] * 10 + [(-1.0) ** k] * (n - 10), [0] * n))
    orders = shuffled_orders(len(base), 2, torch.Generator().manual_seed(0))
    packs = minibatches(orders[0], 3)
    runs = []
    with precision("bf16"):
        for m, anchor in zip(models, (False, True), strict=True):
            samples = copy.deepcopy(base)
            todo = packs[1:] if anchor else packs
            flat = [i for p in todo for i in p]
            cuts = [0]
            for p in todo:
                cuts.append(cuts[-1] + len(p))
            score_old(m, [samples[i] for i in flat], 2048, 0, 1.0, tree=tree,
                      groups=[list(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
            assert all(samples[i].old is None for i in packs[0]) is anchor
            st = train_on_samples(m, torch.optim.SGD(m.parameters(), lr=1e-2), None, samples,
                                  StepLoss(PolicyLossConfig(), version=0),
                                  fields=("advantages", "behaviour", "versions", "old"), epochs=2, minibatch_size=3,
                                  max_tokens=2048, max_grad_norm=None, per_token=True, pad_id=0, temperature=1.0,
                                  orders=orders, anchor_first=anchor, tree=tree)
            runs.append((samples, st))
    (full, st_full), (anchored, st_anchored) = runs
    assert [s.old for s in anchored] == [s.old for s in full]  # every sample's anchor, bit for bit
    assert [s.old_entropy for s in anchored] == [s.old_entropy for s in full]
    assert st_anchored["train/optimizer_steps"] == st_full["train/optimizer_steps"] == 6
    moved = False
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        if tree:  # a shared action token's anchor, from the pass, is the mean of its copies: rounded
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name
        moved |= not torch.equal(a, _wide_random_model().get_parameter(name))
    assert moved  # the updates did move the weights, the same way


@pytest.mark.parametrize("sets, anchors", [
    (["train.trainable=lora", "train.lora.dropout=0.0"], True),
    (["train.trainable=lora", "train.lora.dropout=0.1"], False),
    (["train.distill={teacher: expert}"], False),
])
def test_dropout_or_a_teacher_keeps_the_whole_scoring_pass(tmp_path, sets, anchors):
    """With dropout the update's forward (train mode) is random and the pass's (eval mode) is not;
    a teacher reads every sample's scores before the update. Both keep the pass over all."""
    tr = Trainer(load_train_config(None, GUESS + [*sets, f"train.output.dir={tmp_path}"]), progress=False)
    assert tr.learner.anchors_first_minibatch() is anchors


def test_dropout_in_sees_dropout_modules_and_attention_rates():
    import transformers

    from agentrl.train.model import dropout_in

    assert not dropout_in(_wide_random_model())
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1)
    assert dropout_in(transformers.LlamaForCausalLM(cfg))
    assert dropout_in(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    assert not dropout_in(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))


def test_anchor_first_without_the_epochs_orders_is_refused():
    from agentrl.train.batch import train_on_samples
    from agentrl.train.loss import StepLoss

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="anchor_first needs the epochs' orders"):
        train_on_samples(model, torch.optim.SGD(model.parameters(), lr=0.1), None, [], StepLoss(), fields=(),
                         epochs=1, minibatch_size=1, max_tokens=8, max_grad_norm=None, per_token=True, pad_id=0,
                         temperature=1.0, generator=torch.Generator(), anchor_first=True)


def test_the_learner_scores_old_logprobs_in_the_first_epoch_s_minibatches(tmp_path, monkeypatch):
    """The scoring pass packs the first epoch's minibatches but the first, in the update's order;
    the first anchors to its own forward, whose log-probs become its samples' old ones."""
    import agentrl.train.step as step_module

    torch.set_num_threads(1)
    cfg = load_train_config(None, GUESS + ["train.precision=bf16", "train.old_logprobs=rescore", "train.epochs=2",
                                           "train.minibatch_size=3", f"train.output.dir={tmp_path}"])
    tr = Trainer(cfg, progress=False)
    ran, first_rows, scored, batch = [], [], [], []
    minibatch_step, row_loss, score_old = batch_module.minibatch_step, batch_module.row_loss, step_module.score_old

    def count(net: Any, samples: Any, idx: list[int], *a: Any, **kw: Any) -> Any:
        ran.append(list(idx))
        batch[:] = samples
        return minibatch_step(net, samples, idx, *a, **kw)

    def spy(logprobs: torch.Tensor, entropies: torch.Tensor, row: Any, spec: Any) -> Any:
        if len(ran) == 1:
            assert "old" not in row.values  # the loss anchors to these log-probs, detached
            first_rows.append((row.seq_index, row.per_sample(logprobs)))
        return row_loss(logprobs, entropies, row, spec)

    def old_pass(net: Any, samples: Any, *a: Any, **kw: Any) -> Any:
        scored.append(([id(s) for s in samples], kw["groups"]))
        return score_old(net, samples, *a, **kw)

    monkeypatch.setattr(batch_module, "minibatch_step", count)
    monkeypatch.setattr(batch_module, "row_loss", spy)
    monkeypatch.setattr(step_module, "score_old", old_pass)
    tr.run()
    assert len(ran) == 6 and ran[3:] != ran[:3]  # two epochs of 3, 3, 2 (8 episodes); the second draws its own order
    ((ids, groups),) = scored
    assert ids == [id(batch[i]) for g in ran[1:3] for i in g]  # the first minibatch is not scored
    assert groups == [[0, 1, 2], [3, 4]]  # packed as the update packs the second and third
    assert first_rows and sorted(i for idx, _ in first_rows for i in idx) == sorted(ran[0])
    assert all(batch[i].old == lp for idx, lps in first_rows for i, lp in zip(idx, lps, strict=True))
    row = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
           if r.get("phase") == "rl"][-1]
    assert row["train/scoring_pass"] == 1 and row["train/scored_samples"] == 5
