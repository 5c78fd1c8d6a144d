"""Record the viewer tests' branched run: a real, tiny training run whose trees are kept per step.

    .venv/bin/python tests/viewer/record_run.py tests/viewer/data/branched_run

The tiny random model on GuessNumber (1..8, 3 guesses), segment trees (depth 2,
width 2), tree credit plus distillation from the env's scripted expert, 2 steps
on the same 2 task seeds (so that two steps of one task can be compared), and a
held-out evaluation on 2 seeds. The trainer does not save its trees yet, so
this script does: ``trees/step-00000k.jsonl`` per step, each tree with
``meta["token_values"]`` (the advantages the update used, and the teacher's
and student's log-probs), the format ``agentrl.viewer.payload`` reads. The
checkpoint's weights are deleted; its ``state.json`` (the run config) stays.
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
from agentrl.types import write_trees

CONFIG: dict[str, Any] = {
    "policy": {"backend": "hf", "model": "tiny-random"},
    "sampling": {"temperature": 1.0, "max_new_tokens": 6, "stop": ["\n"]},
    "env": {"id": "agentrl/GuessNumber-v0", "kwargs": {"high": 8, "max_turns": 3}},
    "rollout": {"group_size": 4, "max_turns": 3, "max_context_tokens": 512, "allocator": {"name": "segment_tree", "depth": 2, "width": 2, "segment_turns": 1}},
    # a short SFT on the expert first, so that the random model guesses numbers and some episodes win
    "sft": {"episodes": 32, "epochs": 30, "lr": 1e-2, "minibatch_size": 16},
    "train": {"steps": 2, "tasks_per_step": 2, "task_seeds": [3, 5], "credit": "tree",
              "distill": {"teacher": "expert", "weight": 0.5}, "minibatch_size": 8, "lr": 1e-3,
              "micro_batch_tokens": 2048, "eval_episodes": 2, "export_hf": False,
              "tensorboard": False, "plot": False},
}


class RecordingTrainer(Trainer):
    """The trainer, writing each step's trees with the values its update used."""

    def rollout(self, step: int, bars: Any, *args: Any, **kwargs: Any) -> Any:
        trees, stats = super().rollout(step, bars, *args, **kwargs)
        self._samples: list[Any] = []
        return trees, stats

    def _score(self, samples: list[Any], step: int, one_step: bool) -> Any:
        out = super()._score(samples, step, one_step)
        self._samples = samples  # advantages now include the distillation term
        return out

    def learn(self, trees: list[Any], step: int, bars: Any) -> dict[str, Any]:
        stats = super().learn(trees, step, bars)
        where = {id(n): (t, n.id) for t in trees for n in t.nodes.values()}
        for s in self._samples:
            tree, leaf = where[id(s.episode.nodes[-1])]
            on = [i for i, m in enumerate(s.mask) if m]
            student = s.old if s.old is not None else s.behaviour
            tree.meta.setdefault("token_values", {})[str(leaf)] = {
                "advantages": [round(s.advantages[i], 6) for i in on],
                "teacher_logprobs": [round(s.distill.teacher[i], 6) for i in on] if s.distill.teacher else None,
                "student_logprobs": [round(student[i], 6) for i in on],
            }
        folder = self.out / "trees"
        folder.mkdir(parents=True, exist_ok=True)
        write_trees(folder / f"step-{step + 1:06d}.jsonl", trees)
        return stats


def record(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    cfg = TrainRunConfig.model_validate({**CONFIG, "train": {**CONFIG["train"], "out_dir": str(out)}})
    trainer = RecordingTrainer(cfg, console=Console(quiet=True), progress=False)
    from agentrl.train.sft import sft_phase

    trainer.run(sft=sft_phase)
    for ck in (out / "checkpoints").iterdir():  # keep the config, not the weights
        for f in ck.iterdir():
            if f.name != "state.json":
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return out


if __name__ == "__main__":
    print(record(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/viewer/data/branched_run")))
