"""``train.precision``: bf16 autocast of the training and scoring passes, on CPU too."""

from __future__ import annotations

import pytest
import torch

import agentrl.precision as precision_module
import agentrl.train.batch as batch
from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config
from agentrl.train.model import (
    autocast,
    cpu_has_native_bf16,
    precision,
    precision_note,
    resolved_precision,
)
from agentrl.train.trainer import train

from .test_sft import GUESS
from .test_trainer import toy_config

CPU = torch.device("cpu")


def _record_passes(monkeypatch) -> list[tuple[bool, bool]]:
    """(gradient on, CPU autocast on) of every training-side forward from now on."""
    seen: list[tuple[bool, bool]] = []
    real = batch.token_scores

    def spy(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "token_scores", spy)
    return seen


def _matmul_dtype() -> torch.dtype:
    with autocast(CPU):
        return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


def test_autocast_follows_the_precision_in_force():
    assert _matmul_dtype() == torch.float32  # auto: fp32 on CPU (conftest: AGENTRL_CPU_BF16=0)
    with precision("bf16"):
        assert _matmul_dtype() == torch.bfloat16
        with precision("fp32"):  # the innermost block wins
            assert _matmul_dtype() == torch.float32
        assert _matmul_dtype() == torch.bfloat16
    assert _matmul_dtype() == torch.float32  # restored on exit
    with pytest.raises(ConfigError, match="train.precision='fp16'"):
        with precision("fp16"):
            pass


@pytest.mark.parametrize(("caps", "native"), [
    ({"avx2", "fma3"}, False),  # an AVX2-only EPYC: bf16 emulated, about 80x slower than fp32
    ({"avx2", "avx512_f", "avx512_bf16"}, True),
    ({"avx2", "amx_tile", "amx_bf16"}, True),
    (set(), False),  # a torch too old to say: assume none
])
def test_auto_is_bf16_only_on_a_cpu_that_multiplies_bf16_natively(monkeypatch, caps, native):
    monkeypatch.delenv("AGENTRL_CPU_BF16", raising=False)
    monkeypatch.setattr(precision_module, "_cpu_capabilities", lambda: frozenset(caps))
    assert cpu_has_native_bf16() is native
    assert resolved_precision("auto", "cpu") == ("bf16" if native else "fp32")
    with precision("auto"):
        assert _matmul_dtype() == (torch.bfloat16 if native else torch.float32)
    # explicit choices are kept; a GPU is bf16 under auto where it supports bf16 (Ampere on)
    assert resolved_precision("bf16", "cpu") == "bf16" and resolved_precision("fp32", "cpu") == "fp32"
    for gpu_bf16 in (True, False):  # native only: a T4 or V100 emulates bf16, and torch counts that by default
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, v=gpu_bf16: v and not including_emulation)
        assert resolved_precision("auto", "cuda") == ("bf16" if gpu_bf16 else "fp32")
    # asking for bf16 where it is emulated gets a console line; nowhere else
    assert (precision_note("bf16", "cpu") is not None) is (not native)
    assert precision_note("auto", "cpu") is None and precision_note("fp32", "cpu") is None
    assert precision_note("bf16", "cuda") is None


def test_a_torch_that_cannot_report_its_cpu_counts_as_without_native_bf16(monkeypatch):
    def missing():
        raise AttributeError("module 'torch.cpu' has no attribute 'get_capabilities'")

    monkeypatch.delenv("AGENTRL_CPU_BF16", raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", missing)
    precision_module._cpu_capabilities.cache_clear()
    try:
        assert precision_module._cpu_capabilities() == frozenset()
        assert resolved_precision("auto", "cpu") == "fp32"
    finally:
        precision_module._cpu_capabilities.cache_clear()


def test_the_environment_overrides_the_detection_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.setattr(precision_module, "_cpu_capabilities", lambda: frozenset({"avx2"}))
    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    assert resolved_precision("auto", "cpu") == "bf16"
    monkeypatch.setattr(precision_module, "_cpu_capabilities", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    assert resolved_precision("auto", "cpu") == "fp32"
    monkeypatch.setenv("AGENTRL_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match="AGENTRL_CPU_BF16='yes'"):
        resolved_precision("auto", "cpu")


def test_the_plan_shows_the_precision_and_a_run_asking_for_emulated_bf16_is_warned(tmp_path, monkeypatch):
    """The dry run's plan says what auto resolved to; a run with train.precision=bf16 on a CPU
    without native bf16 prints why it will be slow, and still runs."""
    import io

    from rich.console import Console

    from agentrl.train.plan import run_plan
    from agentrl.train.trainer import Trainer

    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    assert run_plan(toy_config(tmp_path, "train.steps=0"))["precision"] == "fp32 (auto on cpu)"
    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    assert run_plan(toy_config(tmp_path, "train.steps=0"))["precision"] == "bf16 (auto on cpu)"
    monkeypatch.setenv("AGENTRL_CPU_BF16", "yes")  # a bad override fails when the run starts
    with pytest.raises(ConfigError, match="AGENTRL_CPU_BF16"):
        run_plan(toy_config(tmp_path, "train.steps=0"))
    with pytest.raises(ConfigError, match="AGENTRL_CPU_BF16"):
        Trainer(toy_config(tmp_path / "bad", "train.steps=0"), progress=False)
    monkeypatch.setenv("AGENTRL_CPU_BF16", "0")
    for name, warned in (("bf16", True), ("auto", False)):
        buf = io.StringIO()
        trainer = Trainer(toy_config(tmp_path / name, "train.steps=0", f"train.precision={name}"),
                          console=Console(file=buf, width=300), progress=False)
        trainer.close()
        assert ("without avx512_bf16 or AMX" in buf.getvalue()) is warned


def test_a_bad_precision_names_its_key():
    with pytest.raises(Exception, match="train.precision"):
        load_train_config(None, ["train.precision=fp16"])


@pytest.mark.parametrize("name, seeds", [("auto", (0,)), ("bf16", (0, 1, 2))])
def test_training_passes_run_at_the_configured_precision_and_still_learn(tmp_path, monkeypatch, name, seeds):
    """Every scoring and training forward runs under bf16 autocast exactly when asked, and GRPO
    on the toy bandit still reaches >= 0.9 held-out success from 0.2-0.8 (as in fp32).

    bf16 over three seeds, two of which must get there: at lr 1e-2 and temperature 0.1 one Adam
    step can flip the bandit's near-greedy replies, and bf16's rounding (a product's 3 significant
    digits, exact otherwise: checked on the CPU that showed it) decides on which seed. On an
    AVX2-only EPYC seed 0 fell from 0.875 to 0.188 rollout success in its last step, where seeds
    1-4 ended at 1.0 and fp32 ended at 0.97-1.0 on all five; with avx512_bf16 seed 0 learned.
    """
    torch.set_num_threads(1)
    seen = _record_passes(monkeypatch)
    ends = []
    for seed in seeds:
        out = train(toy_config(tmp_path / str(seed), "train.steps=4", f"train.precision={name}",
                               f"train.seed={seed}"), progress=False)
        assert 0.2 <= out["phases"]["start"] <= 0.8
        ends.append(out["phases"]["end"])
    assert any(grad for grad, _ in seen) and any(not grad for grad, _ in seen)  # both passes ran
    assert {on for _, on in seen} == {name == "bf16"}
    assert not torch.is_autocast_enabled("cpu")  # nothing leaks out of the run
    assert sum(end >= 0.9 for end in ends) >= len(seeds) - len(seeds) // 3, ends


def test_the_sft_warm_start_runs_at_the_configured_precision(tmp_path, monkeypatch):
    """``agentrl sft``'s training passes (an SFT-only run: ``train.steps=0``) autocast too."""
    torch.set_num_threads(1)
    seen = _record_passes(monkeypatch)
    cfg = load_train_config(None, GUESS + [
        "policy.model=tiny-random", "train.evaluation.episodes=0", "train.micro_batch_tokens=2048",
        "train.output.tensorboard=false", "train.output.plot=false", "train.checkpointing.export_hf=false", "sft.episodes=8",
        "sft.minibatch_size=4", "train.steps=0", "train.precision=bf16", f"train.output.dir={tmp_path}"])
    train(cfg, progress=False)
    # 2 epochs of 2 minibatches (8 episodes, 4 a minibatch), all under bf16
    assert [on for grad, on in seen if grad] == [True] * 4


def _large_logit_model():
    """tiny-random with its head scaled so the likeliest logits sit near 16-32, where bf16's
    8-bit mantissa moves in steps of 0.125-0.25 (the SFT'd SmolLM2's reach that range)."""
    from agentrl.models import load_model

    model, _ = load_model("tiny-random")
    with torch.no_grad():
        model.lm_head.weight.mul_(16.0)  # tied: the embeddings scale too, but RMSNorm undoes that
    return model


def test_under_bf16_the_vocabulary_head_runs_in_fp32_and_logprobs_stay_near_fp32s():
    """Hand-checked: bf16 logits of the same hidden states differ from fp32's by up to a
    quantum (0.125 near 16); with the head in fp32 (``fp32_head``) the trainer's log-probs
    under bf16 autocast differ from fp32's by the body's rounding only, several times less."""
    from agentrl.train.logprobs import fp32_head, token_logprobs

    model = _large_logit_model()
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (2, 48))
    with torch.no_grad():
        ref, _ = token_logprobs(model, ids)
        logits = model(input_ids=ids).logits
        assert 16 < logits.abs().amax(-1).median() < 32  # the regime the fix is for (measured: 20.2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            head_fp32, _ = token_logprobs(model, ids)  # token_scores wraps its forward in fp32_head
            bf16_logits = model(input_ids=ids).logits  # the head in bf16, as before
            with fp32_head(model):
                assert model(input_ids=ids).logits.dtype == torch.float32
        assert "forward" not in model.lm_head.__dict__  # restored on the way out
    bf16_lp = torch.log_softmax(bf16_logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    err_bf16_head = (bf16_lp - ref[:, 1:]).abs().max()
    err_fp32_head = (head_fp32[:, 1:] - ref[:, 1:]).abs().max()
    assert err_bf16_head > 0.04  # measured 0.075: over half a quantum of 0.125
    assert err_fp32_head < err_bf16_head / 5  # measured 0.0034: the body's rounding alone


def test_under_bf16_the_head_runs_fp32_forward_and_backward_and_its_gradient_is_fp32s():
    """Under bf16 autocast the vocabulary head's matmuls are fp32 both ways: the head's weight
    gradient equals the one an fp32 head gives on the same bf16 body output, bit for bit. (A bf16
    backward of the head bought no SFT speed and learned worse: ``fp32_head``'s docstring.)"""
    import agentrl.train.logprobs as logprobs

    model = _large_logit_model()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: its grad is the head's alone
    ids = torch.randint(100, 40000, (1, 16))
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = logprobs.token_logprobs(model, ids, chunk_size=8)
    hook.remove()
    assert seen and all(d == (torch.float32, torch.float32) for d in seen)
    hidden = []
    grab = model.lm_head.register_forward_hook(lambda m, i, o: hidden.append(i[0].detach()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = logprobs.token_logprobs(model, ids, chunk_size=8)
    grab.remove()
    lp.sum().backward()
    got = model.lm_head.weight.grad.clone()
    # the same loss from the captured fp32 head inputs, all fp32: the head's own gradient
    w = model.lm_head.weight.detach().clone().requires_grad_(True)
    x = torch.cat(hidden)
    logp = torch.log_softmax(x @ w.T, dim=-1)
    picked = logp.gather(1, ids[0, 1:, None]).sum()
    (ref,) = torch.autograd.grad(picked, w)
    assert lp.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_training_runs_sampler_computes_in_the_precision_of_its_update(tmp_path, monkeypatch):
    """``policy.precision: auto`` follows ``train.precision`` as it resolves, so the hf sampler
    computes what the update does; a bf16 sampler under an fp32 update cannot anchor PPO
    (``train.old_logprobs: auto`` rescores), whether the config or a handed-in policy says so."""
    from agentrl.models import load_model, load_tokenizer
    from agentrl.policy import HFPolicy
    from agentrl.train.trainer import Trainer

    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    for train_p, policy_p, want, anchor in (("auto", "auto", "bf16", "rescore"), ("fp32", "auto", "fp32", "sampler"),
                                            ("fp32", "bf16", "bf16", "rescore"), ("bf16", "fp32", "fp32", "rescore")):
        trainer = Trainer(toy_config(tmp_path / f"{train_p}-{policy_p}", "train.steps=0", "train.old_logprobs=auto",
                                     f"train.precision={train_p}",
                                     f"policy.precision={policy_p}"), progress=False)
        assert (trainer.policy.precision, trainer.cfg.train.old_logprobs) == (want, anchor), (train_p, policy_p)
        trainer.close()
    model, _ = load_model("tiny-random")
    handed = HFPolicy(model, load_tokenizer("tiny-random"), precision="bf16")
    trainer = Trainer(toy_config(tmp_path / "handed", "train.steps=0", "train.precision=fp32", "train.old_logprobs=auto"),
                      policy=handed,
                      progress=False)
    assert trainer.cfg.train.old_logprobs == "rescore"
    trainer.close()
    with pytest.raises(ConfigError, match="samples in bf16"):
        Trainer(toy_config(tmp_path / "refused", "train.steps=0", "train.precision=fp32", "train.old_logprobs=sampler"),
                policy=HFPolicy(model, load_tokenizer("tiny-random"), precision="bf16"), progress=False)
