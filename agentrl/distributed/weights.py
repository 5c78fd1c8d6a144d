"""The weights as they travel to rollout workers: LoRA adapters merged in, each tensor once.

``merged_weights`` gives the plain model's state dict of a model that may carry
LoRA adapters (``train.trainable: lora``), so a worker holding the plain model
samples what the adapted one does; ``wire_weights`` is that state dict as it
goes into Ray's object store.
"""

from __future__ import annotations

from typing import Any

__all__ = ["merged_weights", "wire_weights"]


def merged_weights(model: Any) -> dict[str, Any]:
    """``model``'s state dict under the plain model's names: where LoRA adapters are injected
    (``train.trainable: lora``), each adapted weight merged (``W + delta``, from peft's own
    ``get_delta_weight``) and the adapter tensors left out, so a worker holding the plain
    model samples what the adapted one does. Only the adapters a layer's forward runs are
    merged (``_running_adapters``): a layer with none gives its base weight. Without adapters:
    ``model.state_dict()``."""
    import torch

    adapted = {name: m for name, m in model.named_modules()
               if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")}
    if not adapted:
        return model.state_dict()
    out: dict[str, Any] = {}
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if ".lora_" in k:
                continue
            name, sep, param = k.partition(".base_layer.")
            if sep:
                m = adapted[name]
                running = _running_adapters(m)
                if param == "weight" and running and not getattr(m, "merged", False):
                    v = v + sum(m.get_delta_weight(a) for a in running).to(v.dtype)
                k = f"{name}.{param}"
            out[k] = v
    return out


def _running_adapters(layer: Any) -> list[str]:
    """The adapters peft's forward of ``layer`` adds: none while its adapters are disabled,
    else the active ones the layer holds (an adapter may target other layers only; the
    forward skips it, and ``get_delta_weight`` would raise ``KeyError``)."""
    if getattr(layer, "disable_adapters", False):
        return []
    names = getattr(layer, "adapter_layer_names", ("lora_A",))
    return [a for a in layer.active_adapters if any(a in getattr(layer, n, {}) for n in names)]


def wire_weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict as it goes into the object store: each tensor once (a tied weight is
    sent under its first name; ``update_weights`` counts its twin as given), as a numpy array
    where numpy has the dtype (Ray stores those without pickling and workers map them in
    place), else as a tensor (bfloat16)."""
    import torch

    out: dict[str, Any] = {}
    seen: set[tuple[Any, ...]] = set()
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            # a twin is found where the weights live: on a GPU each .cpu() makes its own copy
            twin = (v.device, v.data_ptr(), tuple(v.shape), v.stride())
            if v.numel() and twin in seen:
                continue
            seen.add(twin)
            v = v.detach().cpu()
            if v.dtype != torch.bfloat16:
                v = v.numpy()
        out[k] = v
    return out
