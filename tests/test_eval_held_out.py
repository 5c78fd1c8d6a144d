"""The trainer's held-out evaluation plays as ``agentrl eval`` does unless told otherwise:
greedy (temperature 0), whatever ``sampling.temperature`` the training rollouts use."""

from __future__ import annotations

from typing import Any

import pytest

from agentrl.config import Config
from agentrl.evaluation import EvaluationConfig, evaluate_held_out
from agentrl.train.config import load_train_config


def _played_temperature(cfg: Config, ev: EvaluationConfig) -> float:
    """The sampling temperature ``evaluate_held_out`` hands its rollouts (no episode runs)."""
    seen: list[float] = []

    def collect_fn(env_id: str, policy: Any, run: Config, seeds: list[int], on_episode_done: Any = None):
        seen.append(run.sampling.temperature)
        return []

    evaluate_held_out(None, cfg, ev, collect_fn=collect_fn)
    return seen[0]


@pytest.mark.parametrize(("given", "played"), [
    ([], 0.0),  # not set: greedy, as agentrl eval
    (["train.evaluation.temperature=0.6"], 0.6),  # set: as given
    (["train.evaluation.temperature=null"], 0.9),  # null: the training rollouts' sampling.temperature
])
def test_held_out_evaluation_is_greedy_unless_its_temperature_is_set(given, played):
    cfg = load_train_config(overrides=["sampling.temperature=0.9", *given])
    assert _played_temperature(cfg, cfg.train.evaluation) == played


def test_the_evaluation_temperature_default_is_0_and_says_so():
    field = EvaluationConfig.model_fields["temperature"]
    assert EvaluationConfig().temperature == 0.0
    assert "agentrl eval" in field.description and "greedy" in field.description
