"""Training metrics: one JSON line per step, TensorBoard scalars, a learning-curve PNG, progress bars.

Names are namespaced the CleanRL way (``rollout/success``, ``loss/clipfrac``,
``time/rollout_s``). ``metrics.jsonl`` is the record of truth; TensorBoard
(when the ``tensorboard`` package is installed) and the PNG are views of it.
A resumed run first drops the lines of steps after its checkpoint, which the
resumed run is about to redo, so the file never holds a step twice.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

__all__ = ["MetricsLogger", "PeakMemory", "ProgressBars", "advantage_balance", "learning_curve_series", "merge_stat",
           "plot_learning_curve", "read_metrics"]


class ProgressBars:
    """Rich progress bars, one per phase, reset every step."""

    def __init__(self, console: Console, enabled: bool):
        self.progress = Progress("[progress.description]{task.description}", BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 disable=not enabled)
        self.tasks: dict[str, Any] = {}

    def start(self, phase: str, total: int, label: str = "") -> Callable[..., None]:
        desc = f"{phase:<8} {label}"
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(desc, total=total)
        else:
            self.progress.reset(self.tasks[phase], total=total, description=desc)
        task = self.tasks[phase]
        return lambda *_: self.progress.advance(task)

    def __enter__(self) -> ProgressBars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)


class PeakMemory:
    """The process's peak resident memory over a phase (``memory/peak_rss_mb``), and on a GPU
    the peak allocated by torch (``memory/peak_cuda_mb``).

    Linux resets the kernel's high-water mark (``VmHWM``) when 5 is written to
    ``/proc/self/clear_refs``, so each phase reports its own peak. Where that
    file cannot be written, the peak since the process started is reported
    (``resource.getrusage``), which only grows.
    """

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict[str, float]:
        out = {"memory/peak_rss_mb": round(self._rss_mb(), 1)}
        import torch

        if torch.cuda.is_available():
            out["memory/peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return out

    @staticmethod
    def _rss_mb() -> float:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def advantage_balance(advantages: list[list[float]], masks: list[list[int]]) -> float:
    """``sum A_t / sum |A_t|`` over the trained tokens of a batch (``adv/token_balance``), in [-1, 1].

    A token-mean loss weighs each token alike, so where one outcome's episodes
    run longer (failed searches that use every turn) the group's zero-mean
    advantages stop cancelling: a negative balance is an update that lowers the
    sampled tokens' probabilities on net. The trainer logs it for the credit's
    advantages, before any distillation term. 0 when no token has an advantage.
    """
    total = absolute = 0.0
    for adv, mask in zip(advantages, masks, strict=True):
        for a, m in zip(adv, mask, strict=True):
            if m:
                total += a
                absolute += abs(a)
    return total / absolute if absolute else 0.0


def merge_stat(stats: dict[str, float], key: str, value: float, weight: float) -> None:
    """Add ``weight * value`` to ``stats[key]``; a ``/max_`` statistic keeps the largest instead."""
    if "/max_" in key:
        stats[key] = max(stats.get(key, value), value)
    else:
        stats[key] = stats.get(key, 0.0) + weight * value


def _scalar(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


class MetricsLogger:
    """Append ``{"step": k, ...}`` lines to ``out_dir/metrics.jsonl`` and mirror them to TensorBoard.

    ``resume_step``: the step the run goes on from (-1: from the start); the rows and the
    TensorBoard events of later steps are dropped first, since the run redoes them."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional: metrics.jsonl still holds everything
                self.writer = None
            else:
                # The events of the steps the file just dropped are hidden too (TensorBoard's purge:
                # every event at or after this step, in the folder's older files), else it shows
                # the abandoned run's steps beside the ones this run redoes.
                purge = resume_step + 1 if resume_step is not None else None
                self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=purge)

    def _truncate_after(self, step: int) -> None:
        """Keep only lines of steps <= ``step`` (written atomically)."""
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=float) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if (x := _scalar(v)) is not None:
                    self.writer.add_scalar(k, x, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``. A torn last line (a kill mid-write) is skipped; an
    unreadable line before it (a hand's or a disk's doing) is skipped with a warning naming it."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, an int past 4,300 digits, nested past the parser
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif i < len(lines) and line.strip():
            warnings.warn(f"{p}:{i}: skipped a line that is not a metrics row", RuntimeWarning, stacklevel=2)
    return rows


# The keys the trainer writes (loss.py's ``loss/pg``, batch.py's ``loss/entropy_mean``).
_PANELS = (
    ("success rate", ("rollout/success", "eval/success")),
    ("reward", ("rollout/reward", "eval/reward")),
    ("policy loss", ("loss/pg",)),
    ("entropy and mismatch", ("loss/entropy_mean", "mismatch/kl")),
)


def learning_curve_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{panel title: {key: [(step, value), ...]}} of the learning-curve panels; keys without data left out."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for name, keys in _PANELS:
        out[name] = {}
        for key in keys:
            pts = [(r["step"], x) for r in rows if (x := _scalar(r.get(key))) is not None]
            if pts:
                out[name][key] = pts
    return out


def plot_learning_curve(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path | None:
    """Draw success, reward, loss and entropy against step; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = learning_curve_series(read_metrics(metrics_path))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (name, series) in zip(axes, panels.items(), strict=True):
        for key, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(png_path)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out
