"""The decoder's layers through ``torch.compile`` in the training and scoring passes (``train.compile``).

Why: a bf16 update on a CPU with AMX spent a quarter of its time in elementwise
ops (norms, rotary, SiLU, residual adds, autocast's casts), each a pass over
memory, and a fifth in the CPU flash-attention kernel's bf16 backward. Inductor
fuses the elementwise ops into a few loops, and with the layers compiled, plain
matmul-and-softmax attention (``eager``) beats that kernel. The update on 32
of make run's SFT episodes went from 358 to 538 tokens/s at 2,048-token rows
(bench/heap_reuse.json). Inside make run the gain is smaller, since each new
kind of pass compiles first and sampling stays eager: its SFT ran at 354
against 310 tokens/s, and the whole job took 15.9 against 17.0 min of training
in the same hour with a warm compile cache (cold, about a minute more), at the
same peak memory (10.7 GB; the GRPO recipe, bench/make_run.json
grpo_recipe_amx_2026_12_06). fp32 gained nothing measurable, with AMX or on an
AVX2-only EPYC (no bf16 at all): there make run's SFT update on 16 episodes ran
at 114-167 tokens/s compiled against 149-158 eager in its warm epoch (2 rounds
of 2 cells each, ``bench/heap_reuse.py --precisions fp32+compile,fp32``), and
the compiled first epoch paid 50-116 against 131-143.

Where it is on: ``make run``'s recipe (examples/train_alfworld_easy.yaml) sets
``auto``; the field's default stays false, since each new kind of pass compiles
first (about 10 s each with a warm cache; make run's SFT compiles 6) and short
jobs would pay that. Before the layers compiled with ``emulate_precision_casts``
(``INDUCTOR_OPTIONS``), make run's RL from the same SFT weights gained less
compiled over 7 paired seeds (-0.072 +- 0.032 at the end). The one cause found:
inductor's fused kernels skipped autocast's bf16 round trips, which shrank an RL
gradient by 1.5% against fp32's and moved it 5.6% from it, against 0.4% and 4.5%
uncompiled (0.5% and 5.0% with the option, no slower). With it, RL over 9 paired
seeds (at 4,096-token rows) ended at +0.005 +- 0.025, and make run's SFT over 6
paired seeds at +0.026 +- 0.045 (4 of them at 2,048: +0.066 +- 0.054). ``auto``
compiles where the passes run in bf16 on a CPU. On a Zen 4 EPYC (avx512_bf16, no
AMX) make run's SFT alone ran 1.13x faster compiled with a warm cache, at 2.2 GB
less; a first make run, cold, took as long as uncompiled (one run each;
bench/make_run.json).

How: inside ``compiled_decoder(model, batch, length)`` each decoder layer's
``_compiled_call_impl`` (the hook ``nn.Module.compile`` sets) holds a compiled
``_call_impl``; outside it, the hook is cleared again, so sampling with the very
same model between two updates (the ``hf`` backend, its KV cache) runs eager.
Dynamo keys its cache by code object and takes parameters as inputs, so the
layers of a model share one compiled graph, recompiled only for a new kind of
input (a batch of 1, no padding mask, the other attention; about 10 s each on 2
cores, once per process). The backward graph is captured with the forward, so
it runs compiled after the block ends.

Attention: on a CPU, ``eager`` while the probabilities it keeps for the
backward fit ``EAGER_ATTENTION_BYTES`` over all layers (``[B, heads, T, T]`` a
layer: make run's rows of 6 x 384 tokens keep about 0.5 GB), else the model's
own (``sdpa``), whose memory grows with T, not T squared. On a GPU the model's
own kernel is kept. The vocabulary head is not compiled (``logprobs.fp32_head``).

The compiled kernels: the ``agentrl`` command keeps them under
``~/.cache/agentrl/inductor`` (``TORCHINDUCTOR_CACHE_DIR``, unless it is set;
``agentrl.cli.process_defaults``), since torch's default, ``/tmp``, empties on a
reboot and the next run compiles cold again. The folder grows with each new torch
or model code's kernels; deleting it costs only a cold compile.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from .model import precision_in_force

__all__ = ["EAGER_ATTENTION_BYTES", "INDUCTOR_OPTIONS", "compile_mode", "compile_resolves_on", "compiled_decoder", "compiler_works"]

EAGER_ATTENTION_BYTES = 1 << 30
# Round where eager rounds: a fused kernel that skips autocast's bf16 round trips computes other
# numbers than the ones the backward saved. On make run's SFT weights that shrank an RL gradient
# by 1.5% against fp32's and put it 5.6% from it, against 0.4% and 4.5% for eager bf16.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

_COMPILE: ContextVar[bool | str] = ContextVar("agentrl_compile", default=False)


@contextlib.contextmanager
def compile_mode(value: bool | str) -> Iterator[None]:
    """Within this block ``compiled_decoder`` follows ``value`` (``auto``, True or False)."""
    if value not in ("auto", True, False):
        raise ValueError(f"train.compile={value!r}: use auto, true or false")
    token = _COMPILE.set(value)
    try:
        yield
    finally:
        _COMPILE.reset(token)


def compile_resolves_on(value: bool | str, device: torch.device | str) -> bool:
    """Whether ``value`` compiles on ``device``: auto = bf16 passes on a CPU (where it was measured)
    that can build inductor's kernels (``compiler_works``)."""
    if value == "auto":
        device = torch.device(device)
        return device.type == "cpu" and precision_in_force(device) == "bf16" and compiler_works()
    return bool(value)


@functools.cache
def compiler_works() -> bool:
    """Whether ``torch.compile`` builds and runs a kernel here (inductor needs a C++ compiler on a CPU).

    Probed once a process; where it fails, ``auto`` runs eager and says why once.
    """
    try:
        x = torch.arange(8.0)
        ok = bool(torch.equal(torch.compile(lambda t: t * 2 + 1, dynamic=False)(x), x * 2 + 1))
    except Exception as e:  # no compiler, no headers, an unsupported platform
        warnings.warn(f"train.compile auto: torch.compile does not work here ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); the passes run eager",
                      stacklevel=2)
        return False
    return ok


def _layers(model: Any) -> list[torch.nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _attention(model: Any, batch: int, length: int, n_layers: int, device: torch.device) -> str:
    own = getattr(model.config, "_attn_implementation", None) or "eager"
    if device.type != "cpu" or own != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return own
    heads = getattr(model.config, "num_attention_heads", 1)
    kept = batch * heads * length * length * 2 * n_layers  # bf16 probabilities, every layer
    return "eager" if kept <= EAGER_ATTENTION_BYTES else own


@contextlib.contextmanager
def compiled_decoder(model: Any, batch: int, length: int) -> Iterator[None]:
    """Run ``model``'s decoder layers compiled within this block, where ``compile_mode`` says so.

    ``batch`` and ``length``: the rows' shape, which picks the attention on a CPU.
    A model without a ``layers`` list, or whose layers someone compiled already, runs as it is.
    """
    mode = _COMPILE.get()
    if mode is False:  # the default: nothing to look up on each pass
        yield
        return
    device = next(model.parameters()).device
    layers = _layers(model)
    if not layers or not compile_resolves_on(mode, device):
        yield
        return
    ours = [layer for layer in layers if layer._compiled_call_impl is None]
    attention = _attention(model, batch, length, len(layers), device)
    before = model.config._attn_implementation
    if attention != before:
        model.set_attn_implementation(attention)
    for layer in ours:
        layer._compiled_call_impl = torch.compile(layer._call_impl, dynamic=True, options=INDUCTOR_OPTIONS)
    try:
        yield
    finally:
        for layer in ours:
            layer._compiled_call_impl = None
        if attention != before:
            model.set_attn_implementation(before)
