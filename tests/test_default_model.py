"""The real default model (SmolLM2-135M-Instruct) end to end. Marked slow; CI runs it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from agentrl.chat import ChatContext
from agentrl.cli import app
from agentrl.models import load_model
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams, sampling_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m")


def test_default_model_answers_in_chat_format(smollm):
    model, tok = smollm
    ctx = ChatContext(tok, [{"role": "user", "content": "What is the capital of France?"}])
    res = HFPolicy(model, tok).generate(
        [GenerateRequest(ctx.ids, SamplingParams(max_new_tokens=24, temperature=0))])[0]
    text = tok.decode(res.token_ids, skip_special_tokens=True)
    assert "Paris" in text
    # A trained model is confident: mean greedy logprob far above uniform (-10.8).
    assert sum(res.logprobs) / len(res.logprobs) > -2.0


def test_default_model_logprobs_match_a_full_forward(smollm):
    model, tok = smollm
    ctx = ChatContext(tok, [{"role": "user", "content": "Name three colours."}])
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, seed=5)
    res = HFPolicy(model, tok).generate([GenerateRequest(ctx.ids, params)])[0]
    ids = torch.tensor([ctx.ids + res.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(ctx.ids) - 1:-1]
    lp = sampling_logprobs(logits, params).gather(-1, torch.tensor(res.token_ids)[:, None])
    assert torch.allclose(lp.squeeze(-1), torch.tensor(res.logprobs), atol=2e-3)


def test_rollout_cli_on_default_model(tmp_path):
    res = CliRunner().invoke(app, ["rollout", "--episodes", "2", "--out", str(tmp_path),
                                   "--set", "sampling.max_new_tokens=8",
                                   "--set", "rollout.max_turns=3", "--no-progress"])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "smollm2-135m" and summary["episodes"] == 2
    assert summary["action_tokens"] > 0 and summary["failed_episodes"] == 0


def test_default_model_prefix_reuse_equals_full_prefill(smollm):
    # Three ALFWorld-style turns with observations of different lengths per episode.
    from agentrl.policy.base import request_seed

    model, tok = smollm
    runs = []
    for cache_mb in (4096, 0):
        policy = HFPolicy(model, tok, prefix_cache_mb=cache_mb)
        ctxs = [ChatContext(tok, [{"role": "user", "content": f"You are in room {i}. Find the mug."}])
                for i in range(3)]
        out = []
        for turn in range(3):
            results = policy.generate([GenerateRequest(list(c.ids), SamplingParams(
                max_new_tokens=8, temperature=0.8, seed=request_seed(1, i, turn))) for i, c in enumerate(ctxs)])
            out.append(results)
            for i, (c, r) in enumerate(zip(ctxs, results, strict=True)):
                c.append_action(r.token_ids, r.logprobs)
                c.append_observation([{"role": "user", "content": "Nothing happens. " * (1 + i * turn)}])
        runs.append(out)
    reuse, full = runs
    assert sum(r.cached_tokens for r in reuse[2]) > 0
    for rt, ft in zip(reuse, full, strict=True):
        for r, f in zip(rt, ft, strict=True):
            assert r.token_ids == f.token_ids
            assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(f.logprobs), atol=2e-3)
