"""A finished run lets go of its models: runs in one process (seeds of a bench, a notebook)
start from the same memory, not on top of the last run's student, teacher and caches."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import torch

from agentrl.models import load_model
from agentrl.policy import HFPolicy
from agentrl.train import trainer as trainer_module
from agentrl.train.trainer import Trainer, train
from tests.train.test_trainer import toy_config

# A teacher (OPD) and a reference model (KL): every model a run may hold.
HEAVY = ["train.steps=1", "train.evaluation.episodes=2", "train.output.plot=false", "train.output.save_trees=0",
         "train.distill={teacher: tiny-random}", "train.loss.kl_coef=0.1"]


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Only reference counting frees objects meanwhile: what survives is held, or in a cycle."""
    load_model("tiny-random")  # first imports of transformers' modules leave frames in cycles
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _models(tr: Trainer) -> dict[str, weakref.ref]:
    assert tr.learner.ref is not None and tr.learner.distiller is not None and tr.learner.distiller.teacher is not None
    return {"policy": weakref.ref(tr.policy), "student": weakref.ref(tr.learner.net), "reference": weakref.ref(tr.learner.ref),
            "teacher": weakref.ref(tr.learner.distiller.teacher), "optimizer": weakref.ref(tr.learner.optimizer)}


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, r in refs.items() if r() is not None]


def test_close_releases_the_models_while_the_trainer_object_lives_on(tmp_path):
    torch.set_num_threads(1)
    with no_cycle_collection():
        tr = Trainer(toy_config(tmp_path, *HEAVY), progress=False)
        refs = _models(tr)
        tr.run()
        tr.close()
        assert _alive(refs) == []
        tr.close()  # idempotent


def test_train_returns_with_the_runs_models_collected(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    made: list[dict[str, weakref.ref]] = []
    init = Trainer.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        made.append(_models(self))

    monkeypatch.setattr(trainer_module.Trainer, "__init__", spy)
    with no_cycle_collection():
        for run in ("a", "b"):
            train(toy_config(tmp_path / run, *HEAVY), progress=False)
            assert _alive(made[-1]) == [], run


def test_a_dropped_hf_policy_is_freed_without_the_cycle_collector(tokenizer):
    with no_cycle_collection():
        model, _ = load_model("tiny-random")
        policy = HFPolicy(model, tokenizer)
        ref = weakref.ref(policy)
        del policy
        assert ref() is None  # its batcher holds its generate weakly: no policy <-> batcher cycle
