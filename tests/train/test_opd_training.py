"""Step-wise on-policy distillation in the loop: the teacher scores the student's turns, KL falls."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.rollout import collect
from agentrl.train.batch import DistillFields, Sample, score_old, score_samples
from agentrl.train.config import TrainConfig, load_train_config
from agentrl.train.distill import (
    DistillConfig,
    add_distill_advantages,
    distill_weight,
    load_teacher,
)
from agentrl.train.metrics import ProgressBars
from agentrl.train.model import sync_policy
from agentrl.train.sft import sft_phase
from agentrl.train.trainer import Trainer

GUESS = ["policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0",
         "env.kwargs={high: 4, max_turns: 3}", "rollout.max_turns=3", "rollout.max_context_tokens=256",
         "sampling.max_new_tokens=3", "train.micro_batch_tokens=2048", "train.evaluation.episodes=0",
         "train.output.tensorboard=false", "train.output.plot=false", "train.checkpointing.export_hf=false"]


def distill_trainer(tmp_path, distill: str, steps: int = 1) -> Trainer:
    """A GuessNumber trainer (2 tasks x 4 episodes a step, one minibatch) with ``train.distill=distill``."""
    torch.set_num_threads(1)
    return Trainer(load_train_config(None, GUESS + [
        "rollout.group_size=4", "train.tasks_per_step=2", f"train.steps={steps}", "train.minibatch_size=8",
        f"train.distill={distill}", f"train.output.dir={tmp_path}"]), progress=False)


def first_step(tr: Trainer) -> tuple[list, dict]:
    """Step 0's rollout trees and the stats of learning on them."""
    bars = ProgressBars(tr.console, False)
    trees, _ = tr.rollout(0, bars)
    return trees, tr.learner.learn(trees, 0, bars.start)


# --------------------------------------------------------------------------- pieces


def test_distill_advantages_add_the_weighted_log_ratio_on_action_tokens_only():
    s = Sample(input_ids=[1, 2, 3, 4], mask=[0, 1, 1, 0], behaviour=[0.0] * 4,
               advantages=[0.0, 0.5, 0.5, 0.0], versions=[-1, 0, 0, -1],
               old=[0.0, -1.0, -2.0, 0.0], distill=DistillFields(teacher=[-9.0, -0.5, -3.0, -9.0]))
    kl = add_distill_advantages([s], weight=2.0)
    # A_distill = log pi_t - log pi_s = [_, 0.5, -1.0, _]; A = A_rl + 2 * A_distill.
    assert s.advantages == pytest.approx([0.0, 1.5, -1.5, 0.0])
    assert kl == pytest.approx((-0.5 + 1.0) / 2)  # mean of log pi_s - log pi_t


def test_distill_weight_follows_its_linear_schedule():
    cfg = DistillConfig(teacher="x", weight=1.0, weight_end=0.0)
    assert [distill_weight(cfg, k, 4) for k in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert distill_weight(DistillConfig(teacher="x", weight=0.3), 7, 4) == 0.3
    steps2 = DistillConfig(teacher="x", weight=1.0, weight_end=0.5, weight_steps=2)
    assert distill_weight(steps2, 1, 100) == pytest.approx(0.75)


def test_credit_none_needs_a_teacher_and_a_teacher_must_load(tokenizer):
    with pytest.raises(ValueError, match="credit: 'none'"):
        TrainConfig(credit="none")
    assert TrainConfig(credit="none", distill={"teacher": "tiny-random"}).distill.weight == 1.0
    with pytest.raises(ConfigError, match="train.distill.teacher='no-such-model'"):
        load_teacher("no-such-model", tokenizer, torch.device("cpu"))


def test_a_vllm_teacher_gets_the_context_length_and_must_share_the_students_tokenizer(monkeypatch, tokenizer):
    import agentrl.policy.vllm as vllm_mod
    from agentrl.train.distill import load_vllm_teacher

    started, closed = [], []

    class Engine:  # stands in for VLLMPolicy: the real one needs .venv-vllm
        def __init__(self, name, **kwargs):
            started.append((name, kwargs))
            self.tokenizer = tokenizer if name == "same" else SimpleNamespace(get_vocab=lambda: {"a": 0})

        def close(self):
            closed.append(True)

    monkeypatch.setattr(vllm_mod, "VLLMPolicy", Engine)
    teacher = load_vllm_teacher("same", tokenizer, 512, gpu_memory_utilization=0.3)
    assert isinstance(teacher, Engine) and not closed
    assert started == [("same", {"max_model_len": 512, "gpu_memory_utilization": 0.3})]
    load_vllm_teacher("same", tokenizer, 512, max_model_len=128)  # the config refuses this key; the loader overrides it
    assert started[-1][1]["max_model_len"] == 512
    with pytest.raises(ConfigError, match="'vllm:other' has another tokenizer"):
        load_vllm_teacher("other", tokenizer, 512)
    assert closed == [True]  # the engine it started is not left running

    def cannot_start(name, **kwargs):
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(vllm_mod, "VLLMPolicy", cannot_start)
    with pytest.raises(ConfigError, match=r"teacher='vllm:big': cannot start it \(no memory for the KV cache\)"):
        load_vllm_teacher("big", tokenizer, 512)


# --------------------------------------------------------------------------- it distills


@pytest.fixture(scope="module")
def sft_teacher(tmp_path_factory):
    """The tiny student's own initial weights after 8 SFT steps on GuessNumber's expert, saved as a folder."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("teacher")
    cfg = load_train_config(None, GUESS + ["sft.episodes=32", "sft.epochs=2", "sft.lr=1e-2",
                                           "sft.minibatch_size=8", f"train.output.dir={out / 'run'}"])
    trainer = Trainer(cfg, progress=False)
    st = sft_phase(trainer.learner)
    assert st["sft/nll_after"] < st["sft/nll_before"] - 5  # the teacher really differs from the student
    trainer.learner.net.save_pretrained(out / "hf")
    trainer.policy.tokenizer.save_pretrained(out / "hf")
    return str(out / "hf")


def _action_logprobs(model: torch.nn.Module, ids: torch.Tensor, action: torch.Tensor, temperature: float = 1.0):
    """Log-probs over the vocabulary at the positions that predict action tokens: ``[n_action, V]``."""
    return torch.log_softmax(model(ids).logits[0, :-1][action] / temperature, -1)


def _episode_tensors(trees) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids [1, L], action mask [L - 1])`` per episode; the mask marks the positions
    that predict an action token."""
    return [(torch.tensor([ep.input_ids]), torch.tensor(ep.loss_mask[1:], dtype=torch.bool))
            for tree in trees for ep in tree.episodes()]


def _held_out_episodes(trainer: Trainer, seeds: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh student rollouts of ``seeds``, as ``_episode_tensors``."""
    return _episode_tensors(collect(trainer.cfg.env.id, trainer.policy, trainer.cfg, seeds))


def held_out_reverse_kl(trainer: Trainer, teacher: torch.nn.Module, seeds: list[int]) -> float:
    """Exact KL(pi_s || pi_t) over the vocabulary, averaged over the action tokens of fresh student rollouts."""
    kls = []
    with torch.no_grad():
        for ids, action in _held_out_episodes(trainer, seeds):
            s = _action_logprobs(trainer.learner.net, ids, action, trainer.learner.temperature)
            t = _action_logprobs(teacher, ids, action)
            kls.append((s.exp() * (s - t)).sum(-1))
    return float(torch.cat(kls).mean())


def fixed_support_lsm(trainer: Trainer, episodes: list[tuple[torch.Tensor, torch.Tensor]], k: int):
    """A function giving the trainer's LSM over ``episodes``' action tokens on a fixed support: the
    student's top-k when this is called, without special ids, as the distiller builds it. Only the
    weights change between calls."""
    from agentrl.train.distill import build_support, distribution_loss

    d = trainer.learner.distiller
    with torch.no_grad():
        support = []
        for ids, a in episodes:
            top = _action_logprobs(trainer.learner.net, ids, a).topk(k).indices
            kept, _ = build_support(top, torch.zeros(top.shape), top, torch.zeros(top.shape), both=False,
                                    special=d._special, vocab=d._vocab)  # LSM: the student's top-k alone
            support.append((top, kept >= 0))

    def measure() -> float:
        total, n = 0.0, 0
        with torch.no_grad():
            for (ids, a), (top, keep) in zip(episodes, support, strict=True):
                s = _action_logprobs(trainer.learner.net, ids, a, trainer.learner.temperature).gather(-1, top)
                t = _action_logprobs(d.teacher, ids, a, d.cfg.teacher_temperature).gather(-1, top)
                ones = torch.ones(1, len(top))
                _, stats = distribution_loss(s[None], t[None], keep[None], ones, ones, d.cfg.signal)
                total, n = total + stats["loss/distill_lsm"] * len(top), n + len(top)
        return total / n
    return measure


def opd_trainer(tmp_path, teacher: str, lr: float, steps: int, options: str = "") -> Trainer:
    """GuessNumber at temperature 0.1, 4 tasks x 4 episodes a step, distillation the only signal."""
    return Trainer(load_train_config(None, GUESS + [
        "sampling.temperature=0.1", "rollout.group_size=4", "train.tasks_per_step=4",
        "train.credit=none", f"train.distill={{teacher: {teacher}{options}}}", f"train.optimizer.lr={lr}",
        f"train.steps={steps}", "train.minibatch_size=16", f"train.output.dir={tmp_path}"]), progress=False)


def opd_run(tmp_path, teacher: str, lr: float, steps: int = 4, options: str = "") -> tuple[float, float, list[dict]]:
    """Held-out exact reverse KL before and after ``steps`` of distillation, and each step's stats."""
    tr = opd_trainer(tmp_path, teacher, lr, steps, options)
    held_out = list(range(1000, 1008))
    before = held_out_reverse_kl(tr, tr.learner.distiller.teacher, held_out)
    bars, log = ProgressBars(tr.console, False), []
    for k in range(steps):
        trees, _ = tr.rollout(k, bars)
        log.append(tr.learner.learn(trees, k, bars.start))
        sync_policy(tr.policy, tr.learner.model)
    return before, held_out_reverse_kl(tr, tr.learner.distiller.teacher, held_out), log


def test_opd_lowers_teacher_student_kl_on_held_out_rollouts_where_lr_zero_does_not(tmp_path, sft_teacher):
    torch.set_num_threads(1)
    before, after, log = opd_run(tmp_path / "opd", sft_teacher, lr=1e-2, steps=3)
    assert before > 1.0  # the student at temperature 0.1 is far from the SFT'd teacher
    print(f"held-out KL(student || teacher): {before:.3f} -> {after:.3f}")
    assert after < 0.7 * before, (before, after)
    assert all(r["distill/weight"] == 1.0 and r["distill/teacher_tokens"] > 0 for r in log)
    assert log[-1]["distill/reverse_kl"] < log[0]["distill/reverse_kl"]
    frozen_before, frozen_after, _ = opd_run(tmp_path / "lr0", sft_teacher, lr=0.0, steps=1)
    assert frozen_before == pytest.approx(before)  # same student, same held-out streams
    assert frozen_after == pytest.approx(frozen_before)


@pytest.mark.parametrize("signal", ["topk_reverse_kl", "forward_kl", "jsd"])
def test_distribution_level_signals_lower_the_exact_kl_on_held_out_rollouts(tmp_path, sft_teacher, signal):
    """Each top-k signal, as the only training signal, pulls the student toward the teacher."""
    torch.set_num_threads(1)
    before, after, log = opd_run(tmp_path, sft_teacher, lr=1e-2, steps=3, options=f", signal: {signal}, top_k: 8")
    key = f"loss/distill_{signal}"
    print(f"{signal}: held-out KL(student || teacher) {before:.3f} -> {after:.3f}; "
          f"{key} by step {[round(r[key], 3) for r in log]}")
    assert all(key in r for r in log) and log[-1][key] < 0.7 * log[0][key]
    assert after < 0.7 * before, (before, after)


def test_lsm_lowers_itself_on_the_batch_and_support_it_trained_on(tmp_path, sft_teacher):
    """LSM matches the teacher's relative preferences on the student's top-K, blind to the mass
    outside it, so it promises no fall of the full KL, nor of LSM on later batches: the student's
    top-K moves. What one update must do is lower LSM on the contexts and support it was computed
    on. Measured once over train.seed 0-4 (not parametrized here): at lr 1e-3 it fell by 33-48%;
    at lr 1e-2 the step overshoots (the student's logits are divided by the temperature 0.1) and
    LSM rose on all five, and 3 such steps raised held-out LSM on 2 of the five."""
    torch.set_num_threads(1)
    tr = opd_trainer(tmp_path, sft_teacher, lr=1e-3, steps=1, options=", signal: lsm, top_k: 8")
    bars = ProgressBars(tr.console, False)
    trees, _ = tr.rollout(0, bars)
    lsm = fixed_support_lsm(tr, _episode_tensors(trees), k=8)
    before = lsm()
    stats = tr.learner.learn(trees, 0, bars.start)
    after = lsm()
    print(f"lsm on the trained batch: {before:.3f} -> {after:.3f}; logged {stats['loss/distill_lsm']:.3f}")
    assert stats["train/optimizer_steps"] == 1
    assert stats["loss/distill_lsm"] == pytest.approx(before, rel=1e-3)  # the same quantity the update saw
    assert after < 0.8 * before, (before, after)


def test_teacher_self_needs_privileged_context():
    with pytest.raises(ValueError, match="train.distill.privileged=true"):
        DistillConfig(teacher="self")
    assert DistillConfig(teacher="self", privileged=True).privileged


def test_privileged_teacher_scores_the_student_tokens_after_its_own_prefix(tokenizer):
    """The teacher reads ``prefix + student ids``; the student's ids are not re-tokenized."""
    from agentrl.train.distill import Distiller, privileged_prefix

    model, _ = load_model_tiny()
    cfg = DistillConfig(teacher="self", privileged=True, weight=1.0)
    distiller = Distiller(cfg, tokenizer, torch.device("cpu"), total_steps=1, student=model)
    ids = tokenizer("Guess a number.\n7\n", add_special_tokens=False)["input_ids"]
    mask = [0] * (len(ids) - 2) + [1, 1]
    sample = Sample(list(ids), mask, [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids))
    sample.distill.privileged = "The secret number is 7."
    score_old(model, [sample], 512, 0, 1.0)
    stats, _ = distiller.teacher_scores([sample], lambda net, ss, temp, **kw: score_samples(net, ss, 512, 0, temp, **kw))
    assert sample.input_ids == ids and len(sample.distill.teacher) == len(ids)
    prefix = privileged_prefix(tokenizer, "The secret number is 7.")
    assert "The secret number is 7." in tokenizer.decode(prefix) and prefix[0] == tokenizer.encode("<|im_start|>")[0]
    with torch.no_grad():  # the same model on prefix + ids, by hand
        logp = torch.log_softmax(model(torch.tensor([prefix + ids])).logits[0, :-1], -1)
    full = prefix + ids
    want = [float(logp[len(prefix) + t - 1, full[len(prefix) + t]]) if m else 0.0 for t, m in enumerate(mask)]
    assert sample.distill.teacher == pytest.approx(want, abs=1e-4)
    assert sample.distill.teacher != pytest.approx(sample.old, abs=1e-3)  # the prefix changed the scores
    assert stats["distill/teacher_tokens"] == len(prefix) + len(ids)
    sample.distill.privileged = None
    with pytest.raises(ConfigError, match="info\\['privileged'\\]"):
        distiller.teacher_scores([sample], lambda *a, **kw: ([], 0))


def test_a_privileged_teacher_scores_constrained_turns_under_the_sampler_s_mask(tokenizer):
    """rollout.constrain: the student sampled token t among ``allowed[t]``; the teacher, reading its
    privileged prefix first, scores the same token among the same ids (the mask moves with the
    prefix), so log p_teacher - log p_student compares two distributions over one support."""
    from agentrl.train.distill import Distiller, privileged_prefix

    model, _ = load_model_tiny()
    distiller = Distiller(DistillConfig(teacher="self", privileged=True, weight=1.0), tokenizer,
                          torch.device("cpu"), total_steps=1, student=model)
    ids = tokenizer("Guess a number.\n7\n", add_special_tokens=False)["input_ids"]
    n = len(ids)
    mask = [0] * (n - 2) + [1, 1]
    forced, free_pick = n - 2, n - 1  # the first action token had one allowed id, the second three
    sample = Sample(list(ids), mask, [0.0] * n, [0.0] * n, [0] * n,
                    allowed={forced: [ids[forced]], free_pick: [ids[free_pick], 11, 12]})
    sample.distill.privileged = "The secret number is 7."
    score_old(model, [sample], 512, 0, 1.0)
    distiller.teacher_scores([sample], lambda net, ss, temp, **kw: score_samples(net, ss, 512, 0, temp, **kw))
    prefix = privileged_prefix(tokenizer, "The secret number is 7.")
    with torch.no_grad():
        logits = model(torch.tensor([prefix + ids])).logits[0]
    keep = sample.allowed[free_pick]
    want = torch.log_softmax(logits[len(prefix) + free_pick - 1, keep], -1)[0].item()
    whole = torch.log_softmax(logits[len(prefix) + free_pick - 1], -1)[ids[free_pick]].item()
    assert sample.distill.teacher[forced] == pytest.approx(0.0, abs=1e-6)  # one choice: certain for both
    assert sample.old[forced] == pytest.approx(0.0, abs=1e-6)
    assert sample.distill.teacher[free_pick] == pytest.approx(want, abs=1e-5)
    assert abs(want - whole) > 0.5  # over the whole vocabulary it would have read another number
    assert sample.allowed == {forced: [ids[forced]], free_pick: keep}  # the student's own mask is unchanged


def test_a_model_teacher_scores_constrained_turns_under_the_sampler_s_mask(tokenizer):
    """Without a privileged prefix the teacher reads the student's own rows, mask included: a
    teacher with the student's weights gives the student's constrained log-probs exactly."""
    from agentrl.train.distill import Distiller

    model, _ = load_model_tiny()
    distiller = Distiller(DistillConfig(teacher="tiny-random", weight=1.0), tokenizer, torch.device("cpu"),
                          total_steps=1, student=model)
    distiller.teacher.load_state_dict(model.state_dict())
    ids = tokenizer("Guess a number.\n7\n", add_special_tokens=False)["input_ids"]
    n = len(ids)
    sample = Sample(list(ids), [0] * (n - 2) + [1, 1], [0.0] * n, [0.0] * n, [0] * n,
                    allowed={n - 2: [ids[n - 2]], n - 1: [ids[n - 1], 11, 12]})
    score_old(model, [sample], 512, 0, 1.0)
    distiller.teacher_scores([sample], lambda net, ss, temp, **kw: score_samples(net, ss, 512, 0, temp, **kw))
    assert sample.distill.teacher[n - 2] == pytest.approx(0.0, abs=1e-6)
    assert sample.distill.teacher == pytest.approx(sample.old, abs=1e-6)
    free = Sample(list(ids), sample.mask, [0.0] * n, [0.0] * n, [0] * n)
    score_old(model, [free], 512, 0, 1.0)
    assert free.old[n - 2] < -1.0  # unmasked, the forced token is far from certain


def test_a_vllm_teacher_is_refused_under_the_admissible_action_constraint():
    with pytest.raises(ConfigError, match=r"train\.distill\.teacher='vllm:\.\.\.' scores .* rollout\.constrain"):
        load_train_config(None, GUESS + ["env.id=agentrl/ALFWorld-v0", "rollout.constrain=admissible",
                                         "train.distill={teacher: 'vllm:smollm2-135m'}"])
    load_train_config(None, GUESS + ["env.id=agentrl/ALFWorld-v0", "rollout.constrain=admissible",
                                     "train.distill={teacher: smollm2-135m}"])


def load_model_tiny():
    from agentrl.models import load_model

    return load_model("tiny-random")


def test_a_privileged_self_teacher_prefers_the_secret(tokenizer):
    """SmolLM2-135M told the secret scores the secret guess above a wrong one: its advantage is higher."""
    from agentrl.models import load_model
    from agentrl.train.distill import Distiller

    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m")
    distiller = Distiller(DistillConfig(teacher="self", privileged=True), tok, torch.device("cpu"), 1,
                          student=model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "I am thinking of a whole number between "
                                       "1 and 16. Guess it: answer with one number only."}],
                                     tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    gaps = {}
    for secret in (5, 11, 13):
        for guess in (secret, 16 - secret + 1 if 16 - secret + 1 != secret else 2):
            action = tok(str(guess), add_special_tokens=False)["input_ids"]
            s = Sample(prompt + action, [0] * len(prompt) + [1] * len(action), [0.0] * (len(prompt) + len(action)),
                       [0.0] * (len(prompt) + len(action)), [0] * (len(prompt) + len(action)))
            s.distill.privileged = f"The secret number is {secret}."
            score_old(model, [s], 1024, 0, 1.0)
            _, token_w = distiller.teacher_scores([s], lambda net, ss, temp, **kw: score_samples(net, ss, 1024, 0, temp, **kw))
            distiller.advantage_term([s], 0, token_w)
            gaps[(secret, guess == secret)] = sum(s.advantages)
    # log p_teacher - log p_student of the guess: telling the 135M model the secret raises the
    # secret's logprob more than a wrong guess's, by 0.18 to 0.38 nats here. A small model uses
    # the hint weakly, so the margin is small but deterministic (no sampling).
    diffs = [gaps[(secret, True)] - gaps[(secret, False)] for secret in (5, 11, 13)]
    assert all(d > 0.1 for d in diffs), gaps


def test_a_training_step_with_a_privileged_self_teacher(tmp_path):
    """The engine keeps the env's privileged text out of every prompt and hands it to the teacher."""
    tr = distill_trainer(tmp_path, "{teacher: self, privileged: true, weight: 0.5}")
    assert tr.learner.distiller.teacher is tr.learner.net  # the student's own weights, not a copy
    trees, stats = first_step(tr)
    tok = tr.policy.tokenizer
    for tree in trees:
        assert tree.meta["privileged"].startswith("The secret number is ")
        for node in tree.nodes.values():
            assert "secret number" not in tok.decode(node.context_ids + node.action_ids)
    episode_tokens = sum(len(ep.input_ids) for t in trees for ep in t.episodes())
    assert stats["distill/teacher_tokens"] > episode_tokens  # each episode behind its prefix
    assert stats["distill/weight"] == 0.5 and stats["train/optimizer_steps"] == 1


# --------------------------------------------------------------------------- scripted experts as teachers


def test_expert_teacher_logprobs_match_the_experts_tokens_then_floor(tokenizer):
    from agentrl.train.distill import expert_teacher_logprobs

    right = tokenizer("go to shelf 1", add_special_tokens=False)["input_ids"]
    wrong = tokenizer("go to desk 2", add_special_tokens=False)["input_ids"]
    nl = tokenizer("\n", add_special_tokens=False)["input_ids"]
    ctx = [1, 2, 3]
    ids = ctx + right + nl + [4, 5] + wrong + nl
    a0, a1 = (3, 3 + len(right) + 1), (3 + len(right) + 1 + 2, len(ids))
    s = Sample(ids, [0] * len(ids), [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids),
               old=[-0.5] * len(ids))
    s.distill.expert_turns = [(a0[0], a0[1], "go to shelf 1", True), (a1[0], a1[1], "go to shelf 1", True)]
    teacher, turns, matched = expert_teacher_logprobs(s, tokenizer, floor=-10.0)
    assert (turns, matched) == (2, 1)
    assert teacher[:3] == [-0.5] * 3  # context: the student's own logprobs, so no signal
    assert teacher[a0[0]:a0[1]] == [0.0] * (a0[1] - a0[0])  # the expert's text, then the student's stop
    first_diff = next(i for i, (x, y) in enumerate(zip(right, wrong, strict=False)) if x != y)
    second = teacher[a1[0]:a1[1]]
    assert second[:first_diff] == [0.0] * first_diff and set(second[first_diff:]) == {-10.0}
    s.distill.expert_turns = [(a0[0], a0[1], None, True)]  # no expert here: the student's logprobs
    assert expert_teacher_logprobs(s, tokenizer, -10.0) == ([-0.5] * len(ids), 0, 0)


def test_engine_records_the_experts_action_in_the_state_each_turn_acted_in(tokenizer):
    from agentrl.policy.mock import MockPolicy

    cfg = load_train_config(None, GUESS + ["env.kwargs={high: 16, max_turns: 3}",
                                           "rollout.record_expert_actions=true"])
    trees = collect(cfg.env.id, MockPolicy(tokenizer, ["3"]), cfg, [0, 1])
    for tree in trees:
        for ep in tree.episodes():
            experts = [n.expert_action for n in ep.nodes]
            assert experts[0] == "8"  # bisection of 1..16, before any guess
            if len(experts) > 1:  # after "3": too low (secret > 3) -> 4..16 -> 10; or the secret was 3
                assert experts[1] == "10"


def test_an_expert_teacher_pushes_the_student_off_actions_the_expert_would_not_take(tmp_path):
    """OPD with GuessNumber's bisection expert as a one-hot teacher, on a tiny random student.

    Such a student never samples the expert's opening "8", so the signal it gets is on its
    own mismatching tokens: the log-prob of the first action it sampled most falls; with
    lr=0 nothing moves.
    """
    from collections import Counter

    torch.set_num_threads(1)

    def run(lr: float) -> tuple[float, float, dict]:
        cfg = load_train_config(None, GUESS + [
            "env.kwargs={high: 16, max_turns: 3}", "sampling.temperature=0.1", "rollout.group_size=4",
            "train.tasks_per_step=4", "train.credit=none", "train.distill={teacher: expert, weight: 0.1}",
            f"train.optimizer.lr={lr}", "train.steps=3", "train.minibatch_size=16", f"train.output.dir={tmp_path / str(lr)}"])
        tr = Trainer(cfg, progress=False)
        assert tr.cfg.rollout.record_expert_actions and not cfg.rollout.record_expert_actions
        trees = collect(cfg.env.id, tr.policy, tr.cfg, list(range(500, 504)))
        root = trees[0].nodes[trees[0].roots[0]]
        opening = root.context_ids
        firsts = Counter(tuple(t.nodes[r].action_ids) for t in trees for r in t.roots)
        action = list(firsts.most_common(1)[0][0])
        assert all(t.nodes[r].expert_action == "8" for t in trees for r in t.roots)

        def logp() -> float:
            with torch.no_grad():
                lp = torch.log_softmax(tr.learner.net(torch.tensor([opening + action])).logits[0] / 0.1, -1)
            return float(sum(lp[len(opening) - 1 + i, t] for i, t in enumerate(action)))

        before, bars, last = logp(), ProgressBars(tr.console, False), {}
        for k in range(3):
            trees, _ = tr.rollout(k, bars)
            last = tr.learner.learn(trees, k, bars.start)
            sync_policy(tr.policy, tr.learner.model)
        return before, logp(), last

    before, after, stats = run(1e-2)
    assert stats["distill/expert_turns"] > 0 and stats["distill/teacher_tokens"] == 0
    assert stats["distill/expert_match_frac"] == 0.0  # the random student never guessed "8"
    assert after < before - 1.0, (before, after)
    frozen_before, frozen_after, _ = run(0.0)
    assert frozen_after == pytest.approx(frozen_before, abs=1e-5)


def test_turn_balance_and_sod_weights_scale_the_signal_per_turn():
    """Hand-computed: a 2-token turn and a 1-token turn, teacher gaps +1, +1 and -2."""
    import math

    def sample():
        s = Sample(input_ids=[1, 2, 3, 4, 5], mask=[0, 1, 1, 0, 1], behaviour=[0.0] * 5,
                   advantages=[0.0] * 5, versions=[0] * 5,
                   old=[0.0, -2.0, -2.0, 0.0, -1.0], distill=DistillFields(teacher=[0.0, -1.0, -1.0, 0.0, -3.0]))
        s.turn_spans = [(1, 3), (4, 5)]
        return s

    plain = sample()
    add_distill_advantages([plain], 1.0)
    assert plain.advantages == pytest.approx([0.0, 1.0, 1.0, 0.0, -2.0])
    # TurnOPD at progress 1: each turn sums to 1 -> the 2-token turn's tokens weigh 1/2.
    turned = sample()
    add_distill_advantages([turned], 1.0, turn_balance=1.0)
    assert turned.advantages == pytest.approx([0.0, 0.5, 0.5, 0.0, -2.0])
    half = sample()
    add_distill_advantages([half], 1.0, turn_balance=0.5)  # w = 0.5 + 0.5 / n_k
    assert half.advantages == pytest.approx([0.0, 0.75, 0.75, 0.0, -2.0])
    # SOD, alpha 0.5: turn divergences 1 and 2 -> weights e^-0.5 and e^-1.
    sod = sample()
    add_distill_advantages([sod], 1.0, sod_alpha=0.5)
    assert sod.advantages == pytest.approx([0.0, math.exp(-0.5), math.exp(-0.5), 0.0, -2 * math.exp(-1.0)])
    with pytest.raises(ValueError, match="turn_spans"):
        s = sample()
        s.turn_spans = None
        add_distill_advantages([s], 1.0, sod_alpha=0.5)


def test_sod_s_turn_divergence_is_over_the_turn_s_tokens_whatever_tip_left_in_the_mask():
    """SOD's d_k is the mean |log pi_s - log pi_t| over turn k's action tokens. TIP (run before)
    leaves tokens out of the mask, and d_k averaged the masked gap, 0 on those tokens: a 4-token
    turn with gaps 1, 1, 3, 3 whose last two TIP dropped got d = 0.5, not 2 (alpha 1: weight
    e^-0.5 for e^-2). The dropped tokens keep their advantage (no signal on them)."""
    import math

    s = Sample(input_ids=[1, 2, 3, 4, 5, 6], mask=[0, 0, 1, 1, 0, 0], behaviour=[0.0] * 6,
               advantages=[0.0] * 6, versions=[0] * 6, old=[0.0] * 6,
               distill=DistillFields(teacher=[0.0, 0.0, -1.0, -1.0, -3.0, -3.0]))
    s.turn_spans = [(2, 6)]
    add_distill_advantages([s], 1.0, sod_alpha=1.0)
    w = math.exp(-2.0)
    assert s.advantages == pytest.approx([0.0, 0.0, -w, -w, 0.0, 0.0])


def test_distill_options_reach_the_loop(tmp_path):
    tr = distill_trainer(tmp_path, "{teacher: tiny-random, turn_balance: true, sod_alpha: 1.0}", steps=2)
    assert tr.learner.distiller._weights(0) == {"turn_balance": 0.0, "sod_alpha": 1.0}
    assert tr.learner.distiller._weights(1) == {"turn_balance": 1.0, "sod_alpha": 1.0}
    _, stats = first_step(tr)
    assert stats["distill/teacher_tokens"] > 0 and stats["train/optimizer_steps"] == 1


def test_expert_stop_strings_of_several_tokens_count_as_matching(tokenizer):
    from agentrl.train.distill import expert_teacher_logprobs

    action = tokenizer("go to shelf 1</action>", add_special_tokens=False)["input_ids"]
    ids = [1, 2] + action
    s = Sample(ids, [0] * len(ids), [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids), old=[-1.0] * len(ids))
    s.distill.expert_turns = [(2, len(ids), "go to shelf 1", True)]
    teacher, turns, matched = expert_teacher_logprobs(s, tokenizer, -20.0, stop=["</action>"])
    assert (turns, matched) == (1, 1) and teacher[2:] == [0.0] * len(action)


def test_an_expert_action_then_more_text_before_the_stop_does_not_match(tokenizer):
    """A turn that stopped with the expert's text, then its stop, matches; one that said the
    expert's text and went on ("go to shelf 1 and open it", then its end token) is another
    action, which the env reads whole. Any stopped turn that began with the expert's tokens
    matched before: every token 0 (probability 1), the words after it too."""
    from agentrl.train.distill import expert_teacher_logprobs

    want = tokenizer("go to shelf 1", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    for said, stop, ok in (("go to shelf 1 and open it", [], False), ("go to shelf 1", [], True),
                           ("go to shelf 1 now</action>", ["</action>"], False),
                           ("go to shelf 1\n", ["\n"], True)):
        action = tokenizer(said, add_special_tokens=False)["input_ids"] + [eos]
        ids = [1, 2] + action
        s = Sample(ids, [0] * len(ids), [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids), old=[-1.0] * len(ids))
        s.distill.expert_turns = [(2, len(ids), "go to shelf 1", True)]
        teacher, turns, matched = expert_teacher_logprobs(s, tokenizer, -20.0, stop=stop)
        assert matched == int(ok), said
        assert teacher[2:2 + len(want)] == [0.0] * len(want)
        assert teacher[2 + len(want):] == ([0.0] if ok else [-20.0]) * (len(action) - len(want)), said


def test_a_privileged_prefix_longer_than_the_micro_batch_still_scores(tmp_path):
    """Episodes fill rollout.max_context_tokens == train.micro_batch_tokens; the teacher's prefix
    makes its sequences longer than that, and the step must still run."""
    torch.set_num_threads(1)
    cfg = load_train_config(None, [
        "policy.model=tiny-random", "env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 4, max_turns: 8}",
        "rollout.max_turns=8", "rollout.max_context_tokens=96", "sampling.max_new_tokens=3",
        "train.micro_batch_tokens=96", "train.evaluation.episodes=0", "train.output.tensorboard=false", "train.output.plot=false",
        "train.checkpointing.export_hf=false", "rollout.group_size=2", "train.tasks_per_step=2", "train.steps=1",
        "train.distill={teacher: self, privileged: true}", f"train.output.dir={tmp_path}"])
    tr = Trainer(cfg, progress=False)
    bars = ProgressBars(tr.console, False)
    trees, _ = tr.rollout(0, bars)
    assert max(len(ep.input_ids) for t in trees for ep in t.episodes()) > 80  # near the 96 cap
    stats = tr.learner.learn(trees, 0, bars.start)
    assert stats["distill/teacher_tokens"] > sum(len(ep.input_ids) for t in trees for ep in t.episodes())


def test_harness_training_refuses_privileged_and_expert_teachers(tmp_path):
    for distill in ("{teacher: self, privileged: true}", "{teacher: expert}", "{teacher: oracle}"):
        with pytest.raises(ConfigError, match="need the native engine"):  # when the config loads
            load_train_config(None, GUESS + [f"train.distill={distill}", "train.harness=python agent.py",
                                             f"train.output.dir={tmp_path}"])


def test_tip_keeps_high_entropy_and_confidently_wrong_tokens(tokenizer):
    """Hand-computed: entropies 0.0..0.9 and gaps that put the one low-entropy token with a large
    gap above the 80% quantile. Kept: H >= median (0.45) -> 5 tokens, plus token 0."""
    from agentrl.train.distill import Distiller

    model, _ = load_model_tiny()
    d = Distiller(DistillConfig(teacher="self", privileged=True, tip=True), tokenizer, torch.device("cpu"),
                  1, student=model)
    n = 10
    gaps = [0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.0]
    s = Sample([7] * (n + 2), [0, 0] + [1] * n, [0.0] * (n + 2), [0.0] * (n + 2), [0] * (n + 2),
               old=[0.0, 0.0] + [-1.0] * n, distill=DistillFields(teacher=[0.0, 0.0] + [-1.0 - g for g in gaps]))
    s.old_entropy = [0.0, 0.0] + [i / 10 for i in range(n)]
    stats = d._informative_tokens([s])
    assert s.mask == [0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert stats["distill/tip_kept_frac"] == pytest.approx(0.6) and stats["distill/tip_dropped_tokens"] == 4
    assert stats["distill/tip_logits_mb_saved"] == pytest.approx(4 * 8 * len(tokenizer) / 2**20)
    with pytest.raises(ValueError, match="tip needs a model teacher"):
        DistillConfig(teacher="expert", tip=True)


def test_tip_in_the_loop_drops_tokens_from_the_update(tmp_path):
    _, stats = first_step(distill_trainer(tmp_path, "{teacher: tiny-random, tip: true}"))
    assert 0 < stats["distill/tip_kept_frac"] < 1 and stats["distill/tip_dropped_tokens"] > 0
    assert stats["train/optimizer_steps"] == 1


# --------------------------------------------------------------------------- hindsight context


def test_hindsight_summary_names_the_groups_best_episode(tokenizer):
    from agentrl.train.distill import hindsight_summary
    from agentrl.types import Node, RolloutTree

    tree = RolloutTree()
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    root = tree.add(Node(action_ids=enc("guess 2")))
    tree.add(Node(action_ids=enc("guess 3"), reward=0.0, terminated=True), root.id)
    tree.add(Node(action_ids=enc("guess 1"), reward=1.0, terminated=True), root.id)
    text = hindsight_summary(tree, tokenizer)
    assert text == ("Hindsight from 2 attempts at this task. The best one (return 1) took these "
                    "actions: guess 2; guess 1")
    head = len(enc(text[:text.index("guess 2")]))
    room = head + len(enc("guess 2")) + 1  # the first action fits, the second does not
    assert hindsight_summary(tree, tokenizer, max_tokens=room).endswith("actions: guess 2; ...")
    tree.nodes[2].reward = 0.0  # both attempts got 0: nothing better to point at
    assert hindsight_summary(tree, tokenizer) == ("Hindsight from 2 attempt(s) at this task: all got "
                                                  "return 0; none did better.")
    broken = RolloutTree()
    broken.add(Node(action_ids=enc("guess 2"), error="env crashed"))
    assert "no attempt" in hindsight_summary(broken, tokenizer)
    with pytest.raises(ValueError, match="privileged_source needs"):
        DistillConfig(teacher="x", privileged_source="hindsight")


def test_a_self_teacher_reads_the_groups_hindsight(tmp_path):
    tr = distill_trainer(tmp_path, "{teacher: self, privileged: true, privileged_source: hindsight}")
    seen: list[str | None] = []
    teacher_scores = tr.learner.distiller.teacher_scores

    def spy(samples, score):
        seen.extend(s.distill.privileged for s in samples)
        return teacher_scores(samples, score)

    tr.learner.distiller.teacher_scores = spy
    trees, stats = first_step(tr)
    assert len(seen) == sum(1 for t in trees for _ in t.episodes())
    assert all(p.startswith("Hindsight from 4 attempt") for p in seen)
    assert len(set(seen)) <= len(trees)  # one summary per task's group
    assert stats["distill/teacher_tokens"] > sum(len(ep.input_ids) for t in trees for ep in t.episodes())


def test_an_expert_with_forward_kl_labels_the_turns_where_the_student_left_it(tokenizer):
    """DAgger: the student's context up to the first turn that differs from the expert's, then the
    expert's action and end token, which alone carry the loss; the student's own tokens carry none."""
    from agentrl.train.distill import Distiller

    right = tokenizer("go to shelf 1", add_special_tokens=False)["input_ids"]
    wrong = tokenizer("go to desk 2", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    ctx = [1, 2, 3]
    ids = ctx + right + [eos] + [4] + wrong + [eos] + [5] + wrong + [eos]
    a0 = (3, 3 + len(right) + 1)
    a1 = (a0[1] + 1, a0[1] + 1 + len(wrong) + 1)
    a2 = (a1[1] + 1, len(ids))
    mask = [1 if any(a <= i < b for a, b in (a0, a1, a2)) else 0 for i in range(len(ids))]
    s = Sample(ids, mask, [-0.5] * len(ids), [0.0] * len(ids), [3] * len(ids))
    s.distill.expert_turns = [(*a0, "go to shelf 1", True), (*a1, "go to shelf 1", True),
                              (*a2, "go to shelf 1", True)]
    d = Distiller(DistillConfig(teacher="expert", signal="forward_kl", weight=0.5), tokenizer,
                  torch.device("cpu"), total_steps=1)
    assert d.labels and not d.needs_student_scores and d.top_k == 0
    [label], stats = d.expert_labels([s], 0, version=7)
    want = right + [eos]
    assert label.input_ids == ids[:a1[0]] + want  # the student's context, then the expert's action
    assert label.mask == [0] * a1[0] + [1] * len(want)
    assert label.advantages == [0.0] * len(label.input_ids)  # no policy-gradient term
    assert label.versions[a1[0]:] == [7] * len(want)
    assert label.distill.support == [[-1]] * a1[0] + [[t] for t in want]
    assert label.distill.weights == [0.0] * a1[0] + [0.5] * len(want)
    assert s.distill.weights == [0.0] * len(ids)  # the student's own tokens: no distillation term
    assert stats["distill/expert_turns"] == 3 and stats["distill/expert_labels"] == 1
    assert stats["distill/expert_match_frac"] == pytest.approx(1 / 3)
    two = Distiller(DistillConfig(teacher="expert", signal="forward_kl", expert_label_turns=2), tokenizer,
                    torch.device("cpu"), total_steps=1)
    assert len(two.expert_labels([s], 0, version=7)[0]) == 2


def test_a_dagger_label_longer_than_the_context_budget_is_left_out(tokenizer, tmp_path):
    """A label is the student's context up to the turn, then the expert's whole action: longer than
    the student's episode where its turn was cut short (the context budget), so past
    ``rollout.max_context_tokens``, which may be ``micro_batch_tokens`` too (the make run recipe),
    and packing its row raised mid-run. Such a label is left out now, and counted."""
    from agentrl.train.distill import Distiller

    right = tokenizer("go to shelf 1", add_special_tokens=False)["input_ids"]
    ids = [1, 2, 3] + right[:1]  # the budget cut the student's only turn after one token
    s = Sample(ids, [0, 0, 0, 1], [-0.5] * 4, [0.0] * 4, [3] * 4)
    s.distill.expert_turns = [(3, 4, "go to desk 2", False)]
    n = 3 + len(tokenizer("go to desk 2", add_special_tokens=False)["input_ids"]) + 1
    for budget, labels in ((n - 1, 0), (n, 1)):
        d = Distiller(DistillConfig(teacher="expert", signal="forward_kl"), tokenizer, torch.device("cpu"),
                      total_steps=1, label_max_tokens=budget)
        out, stats = d.expert_labels([s], 0, version=7)
        assert len(out) == labels and stats["distill/expert_labels_too_long"] == 1 - labels
        assert all(len(x.input_ids) <= budget for x in out)
    tr = distill_trainer(tmp_path, "{teacher: expert, signal: forward_kl}")
    assert tr.learner.distiller.label_max_tokens == tr.cfg.rollout.max_context_tokens == 256


def test_dagger_with_the_bisection_expert_teaches_guess_number(tmp_path):
    """GuessNumber(1..4), tiny random model, distillation from the expert alone (no reward term):
    after 16 steps greedy held-out success is higher than at the start, and the loss fell."""
    torch.set_num_threads(1)
    cfg = load_train_config(None, GUESS + [
        "sampling.temperature=1.0", "rollout.group_size=4", "train.tasks_per_step=4", "train.credit=none",
        "train.distill={teacher: expert, signal: forward_kl}", "train.optimizer.lr=5e-3", "train.steps=16",
        "train.minibatch_size=4", "train.evaluation.episodes=16", "sampling.max_new_tokens=3",
        "train.evaluation.temperature=0", f"train.output.dir={tmp_path}"])
    tr = Trainer(cfg, progress=False)
    summary = tr.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/distill_forward_kl"] for r in rows if r.get("phase") == "rl"]
    print(f"dagger: held-out {summary['phases']['start']:.3f} -> {summary['phases']['end']:.3f}; "
          f"loss {losses}")
    assert losses[-1] < losses[0]
    # Over train.seed 0-2: 0.000 -> 0.250, 0.188, 0.625; the loss from 2.0-2.7 to under 0.3.
    assert losses[-1] < losses[0] / 2
    assert summary["phases"]["end"] >= summary["phases"]["start"] + 0.125


def test_depth_statistic_counts_the_tokens_tip_dropped(tokenizer):
    """TurnOPD's per-turn divergence mass is over every action token both models scored, as SOD's
    is: TIP leaves a token out of the loss, not out of the turn's divergence. Hand-computed: turn 1
    has gaps 0.9 and 0.1 (TIP drops the low-entropy, small-gap second token), turn 2 a gap of 0.5."""
    from agentrl.train.distill import Distiller

    model, _ = load_model_tiny()
    d = Distiller(DistillConfig(teacher="self", privileged=True, tip=True, depth_coverage=0.5), tokenizer,
                  torch.device("cpu"), 1, student=model)
    s = Sample([7] * 5, [0, 1, 1, 0, 1], [0.0] * 5, [0.0] * 5, [0] * 5, old=[0.0, -1.0, -1.0, 0.0, -1.0],
               distill=DistillFields(teacher=[0.0, -1.9, -1.1, 0.0, -1.5]), turn_spans=[(1, 3), (4, 5)])
    s.old_entropy = [0.0, 0.9, 0.0, 0.0, 0.5]
    d._informative_tokens([s])
    assert s.mask == [0, 1, 0, 0, 1]  # TIP dropped the second token of turn 1
    d._update_depth([s])
    assert d.turn_mass == pytest.approx([1.0, 0.5])
    assert d.depth_budget == 1  # 1.0 of 1.5 covers half
