"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random model built from a config."""

from __future__ import annotations

import pytest

from agentrl.models import load_model, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model():
    model, _ = load_model("tiny-random")
    return model
