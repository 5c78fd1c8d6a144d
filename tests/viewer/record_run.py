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

import agentrl.train.step as step_module
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
              "distill": {"teacher": "expert", "weight": 0.5}, "minibatch_size": 8,
              "optimizer": {"lr": 1e-3}, "micro_batch_tokens": 2048, "evaluation": {"episodes": 2},
              "checkpointing": {"export_hf": False}, "output": {"tensorboard": False, "plot": False}},
}


def recording(learn: Any, trainer_out: Path) -> Any:
    """``Learner.learn``, writing each step's trees with the values its update used."""

    def learn_and_record(trees: list[Any], step: int, start_bar: Any) -> dict[str, Any]:
        seen: list[Any] = []
        train_on_samples = step_module.train_on_samples

        def spy(model: Any, optimizer: Any, scheduler: Any, samples: list[Any], *args: Any, **kw: Any) -> Any:
            seen.extend(samples)  # advantages now include the distillation term
            return train_on_samples(model, optimizer, scheduler, samples, *args, **kw)

        step_module.train_on_samples = spy
        try:
            stats = learn(trees, step, start_bar)
        finally:
            step_module.train_on_samples = train_on_samples
        where = {id(n): (t, n.id) for t in trees for n in t.nodes.values()}
        for s in seen:
            tree, leaf = where[id(s.episode.nodes[-1])]
            on = [i for i, m in enumerate(s.mask) if m]
            student = s.old if s.old is not None else s.behaviour
            tree.meta.setdefault("token_values", {})[str(leaf)] = {
                "advantages": [round(s.advantages[i], 6) for i in on],
                "teacher_logprobs": [round(s.distill.teacher[i], 6) for i in on] if s.distill.teacher else None,
                "student_logprobs": [round(student[i], 6) for i in on],
            }
        folder = Path(trainer_out) / "trees"
        folder.mkdir(parents=True, exist_ok=True)
        write_trees(folder / f"step-{step + 1:06d}.jsonl", trees)
        return stats

    return learn_and_record


def record(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    cfg = TrainRunConfig.model_validate({**CONFIG, "train": {**CONFIG["train"], "output": {**CONFIG["train"]["output"], "dir": str(out)}}})
    trainer = Trainer(cfg, console=Console(quiet=True), progress=False)
    trainer.learner.learn = recording(trainer.learner.learn, out)
    from agentrl.train.sft import sft_phase

    trainer.run(sft=sft_phase)
    for ck in (out / "checkpoints").iterdir():  # keep the config, not the weights
        for f in ck.iterdir():
            if f.name != "state.json":
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return out


if __name__ == "__main__":
    print(record(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/viewer/data/branched_run")))
