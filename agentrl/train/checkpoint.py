"""Checkpoints: write a training state atomically, find the newest, load it back.

A checkpoint is a folder ``checkpoints/step-000012`` holding:

- ``trainable.safetensors``: the parameters training changes (all of them for
  full fine-tuning, the top layers, or the LoRA adapters). The frozen rest is
  the base model the config names, so a resume rebuilds that and loads these.
- ``optimizer.pt``: the optimizer's and the LR scheduler's state dicts.
- ``rng.pt``: the python, numpy and torch (and CUDA) random states.
- ``state.json``: the step (which is the data position: step k trains on the
  task seeds of step k), the policy version, and the run config.
- ``hf/`` (optional): the whole model in Hugging Face format
  (``save_pretrained``, LoRA merged), loadable with
  ``AutoModelForCausalLM.from_pretrained``.

Atomicity: everything is written into a hidden temp folder beside the target,
which is then renamed into place; a kill at any moment leaves either the
complete old checkpoints or the complete new one, and stray temp folders are
swept on the next start. A save of a step that has a checkpoint already (a
resumed finished run saves its end again) first sets the old folder aside
under a hidden name and removes it only once the new one is in place; a save
killed in between has it put back the next time the checkpoints are listed.
A folder is removed (replaced or pruned) by renaming it hidden first, so a kill
mid-removal never leaves a partial ``step-N``. Only the newest ``keep``
checkpoints stay.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..models import checkpoint_folders

__all__ = [
    "Checkpoint",
    "capture_rng",
    "checkpoint_dirs",
    "config_changes",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainable",
    "prune_checkpoints",
    "restore_rng",
    "save_checkpoint",
    "trainable_state",
]



@dataclass
class Checkpoint:
    """What ``load_checkpoint`` returns; ``path`` is the folder it came from."""

    path: Path
    step: int
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: dict[str, Any] | None
    state: dict[str, Any] = field(default_factory=dict)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that require grad, detached and contiguous (tied ones appear once)."""
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def capture_rng() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``out_dir/checkpoints``, oldest first (a checkpoint that a
    killed save of its step had set aside is put back first)."""
    root = Path(out_dir) / "checkpoints"
    _put_back_set_aside(root)
    return checkpoint_folders(root)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None


_ASIDE = ".aside-"  # an old step-N while a save of step N moves its new folder into place


def _sweep_temp(root: Path) -> None:
    """Remove temp folders that a killed save left behind."""
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _remove(path: Path) -> None:
    """Remove a checkpoint folder: hidden first (one rename), so no kill leaves part of it listed."""
    try:
        hidden = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-removing-{path.name}-"))
        moved = hidden / path.name
    except OSError:  # a full disk refuses a new folder (ENOSPC) but not a rename, which frees it
        hidden = moved = path.parent / f".tmp-removing-{path.name}"
        shutil.rmtree(hidden, ignore_errors=True)  # what a killed removal of this name left
    try:
        path.rename(moved)
    except OSError:  # as before: a folder that will not move is removed where it is, as far as it goes
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(hidden, ignore_errors=True)


def _put_back_set_aside(root: Path) -> None:
    """A checkpoint set aside by a save of its step that died before its new folder was in
    place is the step's checkpoint still: rename it back (or drop it, where the new one is in)."""
    if not root.is_dir():
        return
    for aside in root.glob(f"{_ASIDE}step-*"):
        target = root / aside.name[len(_ASIDE):]
        if target.exists():
            _remove(aside)
        else:
            aside.rename(target)


def _export_hf(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """``save_pretrained`` of the whole model; a peft model is merged in a copy first."""
    export = model
    if hasattr(model, "merge_and_unload"):
        import copy

        export = copy.deepcopy(model).merge_and_unload()
    export.save_pretrained(str(path), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    state: dict[str, Any] | None = None, *, export_hf: bool = False,
                    tokenizer: Any = None, keep: int | None = 2) -> Path:
    """Write checkpoint ``step`` atomically under ``out_dir/checkpoints``; return its folder.
    Then keep the newest ``keep`` checkpoints (``None``: prune nothing, see ``prune_checkpoints``)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    _put_back_set_aside(root)
    _sweep_temp(root)
    target = root / f"step-{step:06d}"
    aside = root / f"{_ASIDE}{target.name}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{target.name}-"))
    try:
        save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None},
                   tmp / "optimizer.pt")
        torch.save(capture_rng(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **(state or {})}, indent=2,
                                                   default=str))
        if export_hf:
            _export_hf(model, tokenizer, tmp / "hf")
        _fsync_tree(tmp)  # the data is on disk before the rename makes it the checkpoint
        if target.exists():  # a re-run of the same step: kept aside until the new one is in place
            target.rename(aside)
        tmp.rename(target)
        _fsync(root)
    finally:
        if aside.exists() and not target.exists():  # the new one never came: the old one stays
            aside.rename(target)
        shutil.rmtree(tmp, ignore_errors=True)
    if aside.exists():
        _remove(aside)
    if keep is not None:
        prune_checkpoints(out_dir, keep)
    return target


def _fsync(path: Path) -> None:
    """Flush ``path`` to disk. A folder whose filesystem refuses the flush (EINVAL, ENOTSUP:
    FUSE mounts, CIFS; PostgreSQL's fsync_fname skips it alike) is left to it: the rename
    still happened, and a save that raised there lost a run whose checkpoint was in place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (a crash of the machine after the rename must
    not leave a checkpoint whose files are empty)."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def prune_checkpoints(out_dir: str | Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints under ``out_dir/checkpoints``."""
    for old in checkpoint_dirs(out_dir)[:-keep]:
        _remove(old)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint folder written by ``save_checkpoint``."""
    p = Path(path)
    if not (p / "state.json").exists():
        raise FileNotFoundError(f"{p} is not a checkpoint (no state.json)")
    state = json.loads((p / "state.json").read_text())
    opt = _load_plain(p / "optimizer.pt")
    rng = _load_plain(p / "rng.pt")
    return Checkpoint(p, int(state["step"]), load_file(str(p / "trainable.safetensors")),
                      opt["optimizer"], opt["scheduler"], rng, state)


def _load_plain(path: Path) -> Any:
    """``torch.load`` restricted to tensors, plain python values and numpy's random state: a
    checkpoint folder can come from anywhere (a shared drive, a download), and a full unpickle
    runs whatever code the file names."""
    arrays = [np.dtype, np.ndarray, type(np.dtype(np.uint32)), _numpy_reconstruct()]
    with torch.serialization.safe_globals(arrays):
        return torch.load(path, weights_only=True)


def _numpy_reconstruct() -> Any:
    """The function numpy's arrays pickle with, asked of an array rather than imported from
    numpy's private modules (``numpy._core`` in numpy 2, ``numpy.core`` before)."""
    return np.zeros(0).__reduce__()[0]


def config_changes(was: dict[str, Any], now: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{key.path: (was, now)}`` of each leaf of two dumped configs that differs (a list is a leaf)."""
    out: dict[str, tuple[Any, Any]] = {}
    for k in sorted(set(was) | set(now)):
        a, b = was.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = (a, b)
    return out


def load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpointed parameters into ``model``; every trainable one must be there, in its shape."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in tensors)
    if unknown or missing:
        raise ValueError(f"checkpoint does not fit the model: unknown {unknown[:3]}, "
                         f"missing {missing[:3]} (same trainable setting and base model?)")
    # Same names, other shapes: another size of the same architecture (copy_ would say only sizes).
    shaped = [f"{n}: {tuple(t.shape)} in the checkpoint, {tuple(params[n].shape)} in the model"
              for n, t in sorted(tensors.items()) if t.shape != params[n].shape]
    if shaped:
        raise ValueError(f"checkpoint does not fit the model: {len(shaped)} tensors of another shape, "
                         f"{'; '.join(shaped[:2])} (same base model?)")
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
