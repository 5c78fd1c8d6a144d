"""The model side of training: what trains, its optimizer, precision, the reference, weight sync.

One job: set up the model the learning step trains. ``make_trainable`` says
which parameters train (all, the top k layers, or LoRA adapters);
``make_optimizer`` and ``make_scheduler`` build AdamW and its LR schedule;
``reference_model`` is the frozen copy a KL term compares with (LoRA: the
base weights, adapters switched off, ``reference``); ``sync_policy`` hands the
trained weights to the policy that samples.

Precision (``train.precision``, resolved by ``agentrl.precision``): ``auto`` is bf16 autocast on a GPU that
supports bf16, and on a CPU whose instructions multiply bf16 natively (``avx512_bf16`` or AMX:
``cpu_has_native_bf16``), fp32 elsewhere; ``bf16`` autocasts wherever the model
is; ``fp32`` never autocasts. Native bf16 matters by two orders of magnitude:
on a Xeon with AMX the make run recipe's SFT ran 1.6x fp32's tokens/s (the throughput
bench's update: 1.2x there, 1.4x on a Zen 4 EPYC with avx512_bf16 and no AMX),
while on an AVX2-only EPYC bf16 matmuls peaked at 1.2 GFLOP/s against fp32's
182, and a SmolLM2-135M forward and backward ran 18x slower than fp32
(``precision_note`` says so when a run asks for bf16 there).
``AGENTRL_CPU_BF16=1`` or ``0`` overrides the detection (the test suite sets 0,
so ``auto`` is fp32 on every CI machine). The learning step sets the precision
around its passes with ``precision``; the weights and optimizer stay fp32, and
so do the vocabulary head's logits (``logprobs.fp32_head``).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from ..errors import ConfigError
from ..heap import give_back_freed_memory
from ..precision import check_precision, cpu_has_native_bf16, resolved_precision

__all__ = [
    "autocast",
    "base_model",
    "cpu_has_native_bf16",
    "dropout_in",
    "make_optimizer",
    "make_scheduler",
    "make_trainable",
    "precision",
    "precision_note",
    "precision_in_force",
    "reference",
    "resolved_precision",
    "reference_model",
    "schedule_at",
    "sync_policy",
]


# --------------------------------------------------------------------------- precision


_PRECISION: ContextVar[str] = ContextVar("agentrl_precision", default="auto")


@contextlib.contextmanager
def precision(name: str) -> Iterator[None]:
    """Within this block ``autocast`` follows ``name`` (``auto``, ``bf16`` or ``fp32``)."""
    check_precision(name)
    token = _PRECISION.set(name)
    try:
        yield
    finally:
        _PRECISION.reset(token)


def precision_note(name: str, device: torch.device | str) -> str | None:
    """A line for the console when ``name`` on ``device`` is far slower than it need be, else None."""
    if name == "bf16" and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return ("train.precision=bf16 on a CPU without avx512_bf16 or AMX: bf16 matmuls are emulated "
                "here, many times slower than fp32 (an AVX2 EPYC: 1.2 against 182 GFLOP/s); "
                "precision auto picks fp32 on this CPU (the hf sampler follows it: policy.precision auto)")
    return None


def precision_in_force(device: torch.device | str) -> str:
    """``bf16`` or ``fp32``: what the ``precision`` block in force (``auto`` outside any) means on ``device``."""
    return resolved_precision(_PRECISION.get(), device)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast where the precision in force resolves to bf16 on ``device``; else nothing (fp32).

    Outside any ``precision`` block the precision is ``auto``: a caller of ``score_samples`` or
    ``train_on_samples`` that needs fp32 on every machine wraps them in ``precision("fp32")``.
    """
    if precision_in_force(device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- what trains


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (adapters injected), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def dropout_in(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward in train mode is random: a dropout module with p > 0 (a LoRA
    adapter's included), or a layer's own dropout rate above 0 (an attention's ``attention_dropout``)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(isinstance(v := getattr(m, k, None), float) and v > 0
               for k in ("attention_dropout", "dropout", "dropout_p", "attn_dropout")):
            return True
    return False


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    n = getattr(model.config, "num_hidden_layers", None)
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise ConfigError("train.trainable=top_k: cannot find the model's list of decoder layers")


def make_trainable(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """Set what trains; returns the module whose parameters the optimizer and checkpoints see.

    ``full``: every parameter. ``top_k``: the top ``top_k_layers`` decoder
    layers and the final norm (the embeddings and the tied head stay frozen;
    measured 3-4x faster per step than full fine-tuning on CPU for
    SmolLM2-135M). ``lora``: adapters injected into ``model`` in place, so a
    policy holding ``model`` samples with them. ``cfg`` is a ``TrainConfig``.
    """
    if cfg.trainable == "full":
        model.requires_grad_(True)
        return model
    if cfg.trainable == "top_k":
        layers = _decoder_layers(model)
        if cfg.top_k_layers > len(layers):
            raise ConfigError(f"train.top_k_layers={cfg.top_k_layers} but the model has "
                              f"{len(layers)} layers")
        model.requires_grad_(False)
        for layer in list(layers)[-cfg.top_k_layers:]:
            layer.requires_grad_(True)
        norm = getattr(getattr(model, "model", model), "norm", None)
        if norm is not None:
            norm.requires_grad_(True)
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ConfigError("train.trainable=lora needs the peft package: pip install peft") from e
    lc = cfg.lora
    return get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                            target_modules=lc.target_modules, task_type="CAUSAL_LM"))


def make_optimizer(model: torch.nn.Module, lr: float, cfg: Any) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad (``cfg``: ``train.optimizer``, an ``OptimizerConfig``).

    torch's fused kernel (one pass over each tensor, not one per operation) where every
    parameter is a float on a CPU or GPU: make run's compiled bf16 SFT update went from
    about 555 to 600 tokens/s with it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: no parameter requires grad")
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: Any,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``cfg.warmup_steps`` optimizer steps (``cfg``: ``train.optimizer``),
    then constant, cosine or linear to 0."""
    warm, total = cfg.warmup_steps, max(total_steps, 1)

    def factor(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min((t - warm) / max(total - warm, 1), 1.0)
        return 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1 - frac

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def schedule_at(scheduler: torch.optim.lr_scheduler.LambdaLR, position: float) -> None:
    """Put ``scheduler`` at ``position`` optimizer steps of its plan (a fraction is fine) and set
    its learning rates there, as ``position`` calls of ``step()`` would have.

    The RL step places each of its optimizer steps at its share of the step's planned ones
    (``Learner``), so that the schedule follows the run's steps whatever a step's minibatch count.
    """
    lrs = [base * factor(position) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler.last_epoch = position  # type: ignore[assignment]
    scheduler._last_lr = lrs  # what get_last_lr() reports


def sync_policy(policy: Any, model: torch.nn.Module) -> None:
    """Give the policy the trained weights and a new version.

    With the ``hf`` backend in this process the policy holds the very model
    being trained, so the weights are already there: ``weights_updated()``
    bumps its version and drops its prefix cache (keys and values of the old
    weights). Any other backend gets ``update_weights(state_dict)``.
    """
    net = base_model(model)
    if getattr(policy, "model", None) is net:
        if not hasattr(policy, "weights_updated"):
            raise TypeError(f"{type(policy).__name__} holds the trained model but has no weights_updated()")
        policy.weights_updated()
        return
    if model is not net:  # another process's copy of a LoRA model needs merged weights
        net = copy.deepcopy(model).merge_and_unload()
    policy.update_weights({k: v.detach() for k, v in net.state_dict().items()})


def free_before_update(policy: Any, model: torch.nn.Module) -> None:
    """Before an update (an RL step's or the SFT): what the sampling before it left goes back.

    With ``hf`` in this process the policy samples with the very model being trained, so its
    prefix cache is dropped now instead of at ``sync_policy``: the update makes those keys and
    values stale, and during it they sat beside the update's own buffers (up to
    ``prefix_cache_mb``, 4 GiB by default). Other backends keep their caches: their weights
    change at sync. Then the memory freed so far goes back to the kernel
    (``agentrl.heap.give_back_freed_memory``)."""
    if getattr(policy, "model", None) is base_model(model) and hasattr(policy, "drop_prefix_cache"):
        policy.drop_prefix_cache()
    give_back_freed_memory()


# --------------------------------------------------------------------------- the reference


def reference_model(model: torch.nn.Module, kl_coef: float) -> torch.nn.Module | None:
    """A frozen copy of the starting weights for the KL term; None without one, or with LoRA
    (whose reference is the base model with its adapters off, ``reference``)."""
    net = base_model(model)
    if kl_coef == 0 or model is not net:
        return None
    return copy.deepcopy(net).requires_grad_(False).eval()


@contextlib.contextmanager
def reference(model: torch.nn.Module, frozen: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The KL reference to score with: ``frozen``, or ``model`` with its LoRA adapters off."""
    if frozen is not None:
        yield frozen
    else:
        with model.disable_adapter():
            yield base_model(model)
