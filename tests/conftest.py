"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random model built from a config."""

from __future__ import annotations

import os

import pytest

# precision auto means bf16 on a CPU with avx512_bf16 or AMX (agentrl.train.model). The suite's
# exact-match tests compare fp32 sampling with fp32 training, so auto is fp32 on every machine it
# runs on; set before anything is imported, so the subprocesses the tests start inherit it.
os.environ["AGENTRL_CPU_BF16"] = "0"

from agentrl.models import load_model, load_tokenizer
from tests.xdist_crashes import (  # noqa: F401  (hooks: a crashed worker fails its test, not the run)
    pytest_configure,
    pytest_terminal_summary,
    pytest_testnodedown,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model():
    model, _ = load_model("tiny-random")
    return model
