"""``train.compile``: the decoder layers through torch.compile in the training and scoring passes."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch

import agentrl.train.compiled as compiled
import agentrl.train.logprobs as logprobs
from agentrl.errors import ConfigError
from agentrl.models import load_model
from agentrl.train.batch import Sample, train_on_samples
from agentrl.train.compiled import (
    EAGER_ATTENTION_BYTES,
    compile_mode,
    compile_resolves_on,
    compiled_decoder,
)
from agentrl.train.config import OptimizerConfig, load_train_config
from agentrl.train.loss import PolicyLossConfig, StepLoss
from agentrl.train.model import make_optimizer, precision
from agentrl.train.rows import block_causal_mask
from agentrl.train.trainer import train

from .test_sft import GUESS
from .test_trainer import toy_config


def _fresh_model() -> torch.nn.Module:
    model, _ = load_model("tiny-random")  # its own copy: the tests switch its attention
    return model


def _restored(model: torch.nn.Module) -> bool:
    return (all(layer._compiled_call_impl is None for layer in model.model.layers)
            and model.config._attn_implementation == "sdpa")


def _scores_and_grads(model, mode, ids, attn, keep, **kw):
    model.zero_grad()
    with compile_mode(mode):
        out = logprobs.token_scores(model, ids, attn, keep, **kw)
    weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)  # every position's gradient counts
    (out.logprobs * weights).sum().backward()
    return out.logprobs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_compiled_passes_score_and_differentiate_as_eager_ones_do(layout):
    """fp32: the compiled layers (and the eager attention they switch to on a CPU) give the eager
    log-probs and gradients to float rounding, for padded rows (2D mask) and packed ones (4D)."""
    torch.manual_seed(0)
    model = _fresh_model()
    ids = torch.randint(5, 2000, (3, 40))
    kw = {}
    if layout == "padded":
        attn = torch.ones(3, 40, dtype=torch.long)
        attn[1, :12] = 0  # left padding
        keep = attn.bool()
    else:  # two sequences a row, positions restarting at 0
        pos = torch.cat([torch.arange(25), torch.arange(15)]).expand(3, 40).contiguous()
        attn, keep, kw = block_causal_mask(pos), torch.ones(3, 40, dtype=torch.bool), {"position_ids": pos}
    eager_lp, eager_g = _scores_and_grads(model, False, ids, attn, keep, **kw)
    torch._dynamo.reset()  # so that the compiled pass below compiles here, where it is counted
    torch._dynamo.utils.counters.clear()
    comp_lp, comp_g = _scores_and_grads(model, True, ids, attn, keep, **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the layers did go through dynamo
    assert _restored(model)  # sampling after the pass runs the model as it was
    assert eager_lp.abs().sum() > 0 and torch.allclose(comp_lp, eager_lp, atol=1e-5)
    assert len(comp_g) == len(eager_g) > 0
    for c, e in zip(comp_g, eager_g, strict=True):  # fused kernels sum in another order: compare tensors whole
        assert (c - e).norm() <= 1e-4 * e.norm() + 1e-9 and (c - e).abs().max() <= 1e-4 * e.abs().max() + 1e-9


def _samples(model: torch.nn.Module) -> list[Sample]:
    """Three episodes whose behaviour log-probs are the model's own (on-policy, eager fp32)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for n_prompt, n_reply, adv in ((9, 6, 1.0), (14, 3, -1.0), (5, 11, 0.5)):
        ids = torch.randint(5, 2000, (1, n_prompt + n_reply), generator=g)
        with torch.no_grad():
            behaviour = logprobs.token_scores(model, ids).logprobs[0].tolist()
        out.append(Sample(ids[0].tolist(), [0] * n_prompt + [1] * n_reply, behaviour,
                          [0.0] * n_prompt + [adv] * n_reply, [0] * (n_prompt + n_reply)))
    return out


def test_a_compiled_update_moves_the_weights_as_an_eager_one_does():
    """One GRPO minibatch through ``train_on_samples`` (fused AdamW), compiled and eager, from the
    same weights: the same loss and, to float rounding, the same new weights."""
    after, losses = [], []
    for mode in (False, True):
        model = _fresh_model()
        opt = make_optimizer(model, 1e-3, OptimizerConfig(lr=1e-3))
        before = [p.detach().clone() for p in model.parameters()]
        with compile_mode(mode):
            st = train_on_samples(model, opt, None, _samples(model), StepLoss(PolicyLossConfig(), version=0),
                                  fields=("advantages", "behaviour", "versions"), epochs=1, minibatch_size=3,
                                  max_tokens=64, max_grad_norm=1.0, per_token=True, pad_id=0, temperature=1.0,
                                  generator=torch.Generator().manual_seed(0))
        assert _restored(model)
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        after.append([p.detach() for p in model.parameters()])
        losses.append(st["loss/total"])
        assert st["ppo/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy, compiled or not
    assert losses[0] != 0 and losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-7)
    diffs = torch.cat([(c - e).abs().flatten() for c, e in zip(after[1], after[0], strict=True)])
    assert diffs.max() < 1e-5  # 1% of one Adam step of lr 1e-3 (measured: 1.6e-6)


def test_the_block_restores_the_model_when_its_pass_fails():
    model = _fresh_model()
    with compile_mode(True), pytest.raises(RuntimeError, match="inside"):
        with compiled_decoder(model, batch=2, length=8):
            assert model.config._attn_implementation == "eager"  # small rows on a CPU
            assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
            raise RuntimeError("a failure inside the pass")
    assert _restored(model)


def test_a_layer_compiled_by_its_user_is_left_compiled():
    model = _fresh_model()
    mine = model.model.layers[0]
    mine.compile()
    theirs = mine._compiled_call_impl
    with compile_mode(True), compiled_decoder(model, batch=1, length=4):
        assert mine._compiled_call_impl is theirs
    assert mine._compiled_call_impl is theirs and model.model.layers[1]._compiled_call_impl is None


class _RoundTrip(torch.nn.Module):
    """A layer that rounds through bf16 as autocast does between ops."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float() * 3 * self.w


class _Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_RoundTrip()])
        self.config = type("Config", (), {"_attn_implementation": "eager"})()

    def get_decoder(self) -> torch.nn.Module:
        return self


def test_compiled_layers_round_where_eager_rounds():
    """Inductor fuses ``x.to(bf16).float() * 3`` into one loop and, by default, skips the rounding;
    the layers compile with ``emulate_precision_casts`` (on make run's SFT weights the default
    shrank a bf16 RL gradient by 1.5% against fp32's and moved it 5.6% from it, eager bf16 0.4% and
    4.5%). Bit for bit as eager with the option; apart without it (the check has teeth)."""
    model, x = _Decoder(), torch.randn(4096, generator=torch.Generator().manual_seed(0))
    eager = model.layers[0](x)
    torch._dynamo.reset()
    with compile_mode(True), compiled_decoder(model, batch=1, length=8):
        ours = model.layers[0](x)
    assert torch.equal(ours, eager)
    torch._dynamo.reset()
    plain = torch.compile(model.layers[0]._call_impl, dynamic=True)(x)
    assert not torch.equal(plain, eager)
    assert compiled.INDUCTOR_OPTIONS == {"emulate_precision_casts": True}


def test_attention_is_eager_on_a_cpu_only_while_the_probabilities_it_keeps_fit():
    model = _fresh_model()
    layers, heads = len(model.model.layers), model.config.num_attention_heads
    fits = math.isqrt(EAGER_ATTENTION_BYTES // (heads * 2 * layers))  # the longest row of a batch of 1
    cpu = torch.device("cpu")
    assert compiled._attention(model, 1, fits, layers, cpu) == "eager"
    assert compiled._attention(model, 1, fits + 1, layers, cpu) == "sdpa"
    assert compiled._attention(model, 4, fits, layers, cpu) == "sdpa"  # the batch counts too
    assert compiled._attention(model, 1, 8, layers, torch.device("cuda")) == "sdpa"  # a GPU keeps its kernel


def test_auto_compiles_the_bf16_passes_of_a_cpu_that_can_build_kernels(monkeypatch):
    monkeypatch.setattr(compiled, "compiler_works", lambda: True)
    assert not compile_resolves_on("auto", "cpu")  # fp32 passes (conftest: AGENTRL_CPU_BF16=0)
    with precision("bf16"):
        assert compile_resolves_on("auto", "cpu")
        assert not compile_resolves_on("auto", "cuda")  # not measured on a GPU: off unless asked
        monkeypatch.setattr(compiled, "compiler_works", lambda: False)
        assert not compile_resolves_on("auto", "cpu")
    assert compile_resolves_on(True, "cuda") and compile_resolves_on(True, "cpu")
    assert not compile_resolves_on(False, "cpu")
    with pytest.raises(ValueError, match="train.compile='yes'"), compile_mode("yes"):
        pass


def test_a_machine_without_a_cxx_compiler_runs_eager_and_says_why():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from agentrl.train.compiled import compiler_works\nprint(compiler_works())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CXX": "/nonexistent/c++"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "False"
    assert "torch.compile does not work here" in p.stderr and "the passes run eager" in p.stderr


def test_the_config_names_the_key_of_a_bad_value(tmp_path):
    with pytest.raises(ConfigError, match="train.compile"):
        toy_config(tmp_path, "train.compile=sometimes")
    assert toy_config(tmp_path).train.compile is False  # opt-in: RL not yet shown to learn as well compiled
    assert toy_config(tmp_path, "train.compile=auto").train.compile == "auto"
    assert toy_config(tmp_path, "train.compile=true").train.compile is True


def _record_modes(monkeypatch) -> list:
    """The ``train.compile`` in force at every training-side forward (the layers are not compiled)."""
    seen = []

    @contextlib.contextmanager
    def spy(model, batch, length):
        seen.append(compiled._COMPILE.get())
        yield

    monkeypatch.setattr(logprobs, "compiled_decoder", spy)
    return seen


def test_the_rl_step_and_the_sft_run_every_pass_under_train_compile(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    seen = _record_modes(monkeypatch)
    train(toy_config(tmp_path / "rl", "train.steps=1", "train.compile=true"), progress=False)
    assert seen and set(seen) == {True}
    seen.clear()
    train(toy_config(tmp_path / "auto", "train.steps=1", "train.compile=auto"), progress=False)
    assert seen and set(seen) == {"auto"}
    seen.clear()
    train(load_train_config(None, GUESS + [
        "policy.model=tiny-random", "train.evaluation.episodes=0", "train.output.tensorboard=false",
        "train.output.plot=false", "train.checkpointing.export_hf=false", "sft.episodes=4", "sft.minibatch_size=4",
        "train.steps=0", "train.compile=false", f"train.output.dir={tmp_path / 'sft'}"]), progress=False)
    assert seen and set(seen) == {False}
    assert compiled._COMPILE.get() is False  # nothing leaks out of a run


def test_the_plan_and_the_run_say_when_auto_compiles(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from agentrl.train.plan import run_plan
    from agentrl.train.trainer import Trainer

    monkeypatch.setattr(compiled, "compiler_works", lambda: True)
    for bf16, plan in (("1", "on (auto on cpu)"), ("0", "off (auto on cpu)")):
        monkeypatch.setenv("AGENTRL_CPU_BF16", bf16)
        assert run_plan(toy_config(tmp_path, "train.steps=0", "train.compile=auto"))["compile"] == plan
        buf = io.StringIO()
        Trainer(toy_config(tmp_path / bf16, "train.steps=0", "train.compile=auto"),
                console=Console(file=buf, width=300), progress=False).close()
        assert ("train.compile auto: the decoder layers run compiled" in buf.getvalue()) is (bf16 == "1")
    assert run_plan(toy_config(tmp_path, "train.steps=0", "train.compile=true"))["compile"] == "on"
    assert run_plan(toy_config(tmp_path, "train.steps=0"))["compile"] == "off"
