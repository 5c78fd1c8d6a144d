"""Edges of the trainer core found by a hostile review: each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.train.trainer import Trainer
from tests.train.test_trainer import toy_config

_QUIET = ["train.evaluation.episodes=0", "train.output.plot=false"]


def test_resume_with_fewer_trainable_parameters_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    """A checkpoint of a full fine-tune resumed as top_k: its weights fit the model (every name is
    there), but its optimizer state holds a moment for every parameter; torch's bare ValueError
    ('a parameter group that doesn't match the size') named no key. Now a ConfigError names
    train.trainable and what to do, as a change that leaves weights out already did."""
    torch.set_num_threads(1)
    full = Trainer(toy_config(tmp_path, *_QUIET), progress=False)
    try:
        full.save()
    finally:
        full.close()
    top = Trainer(toy_config(tmp_path, *_QUIET, "train.trainable=top_k", "train.top_k_layers=1"), progress=False)
    try:
        with pytest.raises(ConfigError, match=r"train\.trainable: the checkpoint trained 'full', this run 'top_k'"):
            top.resume()
    finally:
        top.close()
