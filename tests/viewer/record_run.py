"""Record the viewer tests' branched run: a real, tiny training run whose trees are kept per step.

    .venv/bin/python tests/viewer/record_run.py tests/viewer/data/branched_run

The tiny random model on GuessNumber (1..8, 3 guesses), segment trees (depth 2,
width 2), tree credit plus distillation from the env's scripted expert, 2 steps
on the same 2 task seeds (so that two steps of one task can be compared), and a
held-out evaluation on 2 seeds. The trainer saves each step's trees
(``trees/step-00000k.jsonl``), each with ``meta["token_values"]`` (the
advantages the update used, and the teacher's and student's log-probs; see
``agentrl.train.token_values``), the format ``agentrl.viewer.payload`` reads.
The checkpoint's weights are deleted; its ``state.json`` (the run config) stays.
About 30 s on 2 CPU cores.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from agentrl.train.config import TrainRunConfig
from agentrl.train.trainer import Trainer

CONFIG: dict[str, Any] = {
    "policy": {"backend": "hf", "model": "tiny-random"},
    "sampling": {"temperature": 1.0, "max_new_tokens": 6, "stop": ["\n"]},
    "env": {"id": "agentrl/GuessNumber-v0", "kwargs": {"high": 8, "max_turns": 3}},
    "rollout": {"group_size": 4, "max_turns": 3, "max_context_tokens": 512, "allocator": {"name": "segment_tree", "depth": 2, "width": 2, "segment_turns": 1}},
    # a short SFT on the expert first, so that the random model guesses numbers and some episodes win
    "sft": {"episodes": 32, "epochs": 30, "lr": 1e-2, "minibatch_size": 16},
    "train": {"steps": 2, "tasks_per_step": 2, "task_seeds": [3, 5], "credit": "tree",
              "distill": {"teacher": "expert", "weight": 0.5}, "minibatch_size": 8,
              "optimizer": {"lr": 1e-3}, "micro_batch_tokens": 2048, "evaluation": {"episodes": 2},
              "checkpointing": {"export_hf": False}, "output": {"tensorboard": False, "plot": False}},
}


def record(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    cfg = TrainRunConfig.model_validate({**CONFIG, "train": {**CONFIG["train"], "output": {**CONFIG["train"]["output"], "dir": str(out)}}})
    trainer = Trainer(cfg, console=Console(quiet=True), progress=False)
    from agentrl.train.sft import sft_phase

    trainer.run(sft=sft_phase)
    for ck in (out / "checkpoints").iterdir():  # keep the config, not the weights
        for f in ck.iterdir():
            if f.name != "state.json":
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return out


if __name__ == "__main__":
    print(record(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/viewer/data/branched_run")))
