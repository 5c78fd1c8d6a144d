"""Which precision a device computes in: bf16 where it multiplies bf16 natively, and the head in fp32.

Shared by the trainer (``train.precision``) and the ``hf`` sampler
(``policy.precision``), so both resolve ``auto`` the same way and compute the
same numbers: bf16 autocast for the body's matmuls, attention's keys and
values in bf16, the norms and the residual stream in fp32, and the vocabulary
head in fp32 (``fp32_head``).

``auto`` is bf16 on a GPU that supports it, and on a CPU whose instructions
multiply bf16 natively (``avx512_bf16`` or AMX: ``cpu_has_native_bf16``); fp32
elsewhere. ``AGENTRL_CPU_BF16=1`` or ``0`` overrides the CPU's answer (the test
suite sets 0, so ``auto`` is fp32 on every CI machine).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from .errors import ConfigError

__all__ = ["PRECISIONS", "check_precision", "command_precision", "cpu_has_native_bf16", "fp32_head", "resolved_precision",
           "run_precision", "sampler_precision"]

PRECISIONS = ("auto", "bf16", "fp32")


def check_precision(name: str, key: str = "train.precision") -> None:
    if name not in PRECISIONS:
        raise ConfigError(f"{key}={name!r}: use auto, bf16 or fp32")


@functools.cache
def _cpu_capabilities() -> frozenset[str]:
    try:
        return frozenset(k for k, v in torch.cpu.get_capabilities().items() if v is True)
    except Exception:  # an older torch without the query: assume none
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (``avx512_bf16`` or AMX's ``amx_bf16``).

    ``AGENTRL_CPU_BF16`` (``1`` or ``0``) overrides what the CPU reports.
    """
    forced = os.environ.get("AGENTRL_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ConfigError(f"AGENTRL_CPU_BF16={forced!r}: use 1 or 0 (or unset it to detect)")
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_capabilities())


def resolved_precision(name: str, device: torch.device | str, key: str = "train.precision") -> str:
    """``bf16`` or ``fp32``: what ``name`` (``auto``, ``bf16``, ``fp32``) means on ``device``."""
    check_precision(name, key)
    if name != "auto":
        return name
    kind = torch.device(device).type
    if kind == "cuda":  # native bf16 only (Ampere on), as on CPU: torch's default check counts emulation
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16" if native else "fp32"
    return "bf16" if kind == "cpu" and cpu_has_native_bf16() else "fp32"


def sampler_precision(policy_precision: str, device: torch.device | str, train_precision: str | None = None) -> str:
    """``bf16`` or ``fp32``: what the hf sampler computes in. ``policy.precision`` when set; for
    ``auto``, ``train.precision`` as it resolves where the config has one (a training run, or a
    training config handed to ``agentrl eval``, ``rollout`` or ``proxy``), so the sampler computes
    what the update does; else the device's own answer."""
    if policy_precision != "auto":
        return resolved_precision(policy_precision, device, "policy.precision")
    if train_precision is not None:
        return resolved_precision(train_precision, device)
    return resolved_precision("auto", device, "policy.precision")


_HEAD_LOCK = threading.Lock()


def _fp32_forward(head: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        if head.weight.dtype == torch.float32:
            return type(head).forward(head, x.float())
        if type(head) is not torch.nn.Linear:  # a wrapped head (LoRA on lm_head): its adapter would be lost
            raise ConfigError(f"the fp32 vocabulary head cannot wrap a {type(head).__name__} over "
                              f"{head.weight.dtype} weights: use policy.dtype float32, or leave lm_head out "
                              "of the LoRA target modules")
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(x.float(), head.weight.float(), bias)


_HEAD_USERS = "_agentrl_fp32_head_users"


@contextlib.contextmanager
def fp32_head(model: Any) -> Iterator[None]:
    """Within this block, under bf16 autocast, the vocabulary head's logits are fp32 products of fp32 inputs.

    bf16 logits carry 8 bits of mantissa: a logit near 16 moves in steps of
    0.125, so the trainer's log-probs of the sampled tokens drift from the
    sampler's (an fp32 one, or a bf16 one with this head) by up to a few
    hundredths of a nat, and PPO's ratio at step 0 is no longer 1 (``bench/precision.json``). The body keeps its bf16
    matmuls; the head, one matmul of the whole model, runs in fp32, forward and
    backward. A bf16 backward of the head (as autocast does for every other
    matmul) was tried: the 128-episode ALFWorld SFT ran at the same speed (362
    against 382 tokens/s) and learned worse on the same seed (final NLL 0.047
    against 0.036, held-out success 0.453 against 0.688). Outside autocast
    (fp32 sampling, fp32 training) this changes nothing.

    Blocks may nest and overlap across threads (a sampler and a trainer over one
    model): the head's own forward comes back when the last one ends. The patch
    is a method bound to the head, so a deep copy made meanwhile (a snapshot of
    the weights) computes with its own head. A head whose weights are not fp32
    (``policy.dtype: bfloat16``) multiplies an fp32 copy of them.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    device = next(model.parameters()).device.type
    if head is None or not torch.is_autocast_enabled(device):
        yield
        return
    with _HEAD_LOCK:
        users = getattr(head, _HEAD_USERS, 0)
        if users == 0:
            head.forward = types.MethodType(_fp32_forward, head)  # removed by the last block out
        setattr(head, _HEAD_USERS, users + 1)
    try:
        yield
    finally:
        with _HEAD_LOCK:
            users = getattr(head, _HEAD_USERS) - 1
            setattr(head, _HEAD_USERS, users)
            if users == 0:
                del head.forward


def command_precision(cfg: Any) -> tuple[str, bool]:
    """``(bf16 or fp32, from its run)``: what the hf sampler of ``agentrl eval``, ``rollout`` or
    ``proxy`` computes in for its loaded ``cfg``: fp32 under ``rollout.deterministic`` (the hf
    backend computes fp32 there), else ``sampler_precision`` with the ``train.precision`` of the
    training config it was given (``agentrl.config.ignored_section``), or, given none, of the run
    whose checkpoint ``policy.model`` is (``run_precision``; then ``from its run`` is true where
    ``policy.precision`` is auto): a run's evaluations and ``agentrl eval`` of its checkpoint then
    score it in one precision."""
    from .config import ignored_section

    if cfg.rollout.deterministic:
        return "fp32", False
    train, recorded = ignored_section(cfg, "train").get("precision"), None
    if not isinstance(train, str):
        train = recorded = run_precision(cfg.policy.model)
    followed = recorded is not None and cfg.policy.precision == "auto"
    return sampler_precision(cfg.policy.precision, cfg.policy.device, train), followed


def run_precision(model: str) -> str | None:
    """``train.precision`` of the run that saved ``model``, a checkpoint's export
    (``checkpoints/step-N/hf``, what ``agentrl.models.exact_model`` gives for a run's folder), as its
    ``state.json`` records it; ``None`` for any other model, or a state that does not say."""
    import json
    from pathlib import Path

    state = Path(model).parent / "state.json"
    if Path(model).name != "hf" or not state.is_file():
        return None
    try:
        got = json.loads(state.read_text())["config"]["train"]["precision"]
    except (OSError, ValueError, KeyError, TypeError):  # a state from elsewhere, or torn: the device decides
        return None
    return got if got in PRECISIONS else None
