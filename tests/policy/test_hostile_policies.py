"""A hostile review of the policy backends: requests at the edges of what a model
or a sampler can do, and OpenAI-compatible servers that answer wrong.

Each case names what a backend must do with it: sample within the model's
context, fail with a ``PolicyError`` that says what is wrong, or refuse the
request before it samples anything the trainer could not score. The fake
servers answer through ``httpx.MockTransport``; nothing leaves the process.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import warnings
from typing import Any

import httpx
import pytest

from agentrl.errors import PolicyError
from agentrl.policy import (
    GenerateRequest,
    GenerateResult,
    HFPolicy,
    MicroBatcher,
    MockPolicy,
    SamplingParams,
)
from agentrl.policy.openai import OpenAIPolicy, retry_delay

# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 5e-324])
def test_a_temperature_between_greedy_and_1e_5_is_refused(temperature):
    # vLLM samples greedily below 1e-5 (its logprobs are then the raw distribution's, not the
    # processed one the trainer scores), and hf's fp32 logits overflow: NaN logprobs, token 0.
    with pytest.raises(PolicyError, match="temperature"):
        SamplingParams(temperature=temperature)


def test_temperatures_from_1e_5_and_greedy_are_accepted():
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    assert SamplingParams(temperature=0).temperature == 0


def test_an_empty_stop_string_is_refused():
    # '' is in every text: every reply would end after one token, with an empty action.
    with pytest.raises(PolicyError, match="stop"):
        SamplingParams(stop=("</answer>", ""))


# --- hf: prompts and limits at the model's edges -----------------------------------------------


@pytest.fixture
def hf(tokenizer, tiny_model):
    policy = HFPolicy(tiny_model, tokenizer)
    yield policy
    policy.close()


@pytest.mark.parametrize("bad", [-1, 49152, 10**12])
def test_prompt_ids_outside_the_vocabulary_fail_as_a_policy_error(hf, bad):
    # torch's IndexError on CPU; on CUDA a device-side assert that poisons every later call
    ok = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, seed=1))
    with pytest.raises(PolicyError, match=r"request 1 .*outside the model's vocabulary"):
        hf.generate([ok, GenerateRequest([1, bad, 3], SamplingParams(max_new_tokens=2, seed=1))])


def test_more_top_logprobs_than_the_vocabulary_fail_as_a_policy_error(hf):
    with pytest.raises(PolicyError, match="logprobs"):
        hf.generate([GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, logprobs=10**6))])


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_sequence_past_the_models_positions_runs_with_one_warning(hf, tiny_model, deterministic):
    # Refusing it broke Codex through the proxy: its system prompt is longer than SmolLM2's
    # 8,192 positions, and the context budget is the caller's (rollout.max_context_tokens).
    hf.deterministic = deterministic
    hf._warned_positions = False
    n = tiny_model.config.max_position_embeddings
    with pytest.warns(RuntimeWarning, match=f"past the {n} positions"):
        (res,) = hf.generate([GenerateRequest([5] * (n - 2), SamplingParams(max_new_tokens=6, seed=1))])
    assert (len(res.token_ids), res.finish_reason) == (6, "length") and len(res.logprobs) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a policy
        hf.generate([GenerateRequest([5] * (n - 2), SamplingParams(max_new_tokens=6, seed=1))])


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_reply_is_never_longer_than_the_models_whole_context(hf, tiny_model, deterministic):
    # A huge max_new_tokens tried to allocate keys and values for all of them (128 TB).
    hf.deterministic = deterministic
    n = tiny_model.config.max_position_embeddings
    huge = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=10**12, seed=3))
    assert hf._limit(huge) == n
    short = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4, seed=3))
    assert hf._limit(short) == 4
    (res,) = hf.generate([GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4, seed=3))])
    assert (len(res.token_ids), res.finish_reason) == (4, "length")


# --- openai: servers that answer wrong ---------------------------------------------------------


class _CannedServer(OpenAIPolicy):
    """``OpenAIPolicy`` whose HTTP goes to ``handler`` through ``httpx.MockTransport``."""

    def __init__(self, tokenizer: Any, handler: Any, **kw: Any):
        super().__init__("http://fake.invalid/v1", "tiny", tokenizer, backoff=0.0, **kw)
        self.transport = httpx.MockTransport(handler)

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = httpx.AsyncClient(base_url=self.base_url, transport=self.transport)
        return self._clients[loop]


def _answer(ids: Any, logprobs: list[Any] | None = None, finish: str = "length",
            tops: list[Any] | None = None) -> dict[str, Any]:
    n = len(ids) if isinstance(ids, list) else 1
    lp: dict[str, Any] = {"token_logprobs": [-0.5] * n if logprobs is None else logprobs}
    if tops is not None:
        lp["top_logprobs"] = tops
    return {"choices": [{"index": 0, "text": "", "finish_reason": finish, "token_ids": ids, "logprobs": lp}]}


@pytest.fixture
def canned(tokenizer):
    made = []

    def make(body: dict[str, Any]) -> OpenAIPolicy:
        text = json.dumps(body)  # NaN as NaN, as Python servers write it
        policy = _CannedServer(tokenizer, lambda request: httpx.Response(
            200, content=text, headers={"content-type": "application/json"}))
        made.append(policy)
        return policy

    yield make
    for policy in made:
        policy.close()


def _ask(policy: OpenAIPolicy, **params: Any):
    params.setdefault("max_new_tokens", 4)
    return policy.generate([GenerateRequest([1, 2, 3], SamplingParams(**params))])[0]


def test_a_well_formed_canned_answer_is_read(canned):
    res = _ask(canned(_answer([5, 6])))
    assert (res.token_ids, res.logprobs, res.finish_reason) == ([5, 6], [-0.5, -0.5], "length")


@pytest.mark.parametrize("ids", [[5.9, 6], [True, 6], ["5", "6"], "56", [-1, 6], [49152, 6], [10**12, 6]],
                         ids=["float", "bool", "str", "a string", "negative", "vocab", "huge"])
def test_token_ids_that_are_not_vocabulary_ids_are_refused(canned, ids):
    # 5.9 became 5, True became 1, "56" became [5, 6]; -1 and 10**12 reached the trainer's embedding
    with pytest.raises(PolicyError, match="token.?id"):
        _ask(canned(_answer(ids, [-0.5, -0.5])))


@pytest.mark.parametrize("bad", [math.nan, 0.5])
def test_a_logprob_that_is_no_log_probability_is_refused(canned, bad):
    with pytest.raises(PolicyError, match="logprob"):
        _ask(canned(_answer([5, 6], [-0.5, bad])))


def test_more_tokens_than_max_tokens_are_refused(canned):
    with pytest.raises(PolicyError, match="max_tokens"):
        _ask(canned(_answer([5, 6, 7, 8, 9])), max_new_tokens=4)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_an_empty_completion_is_refused(canned, finish):
    with pytest.raises(PolicyError, match="no tokens"):
        _ask(canned(_answer([], [], finish=finish)), stop=("x",))


def test_fewer_top_logprobs_than_asked_are_refused(canned):
    tops = [{"token_id:5": -0.5}, {"token_id:6": -0.5, "token_id:7": -1.0}]
    with pytest.raises(PolicyError, match="top logprobs"):
        _ask(canned(_answer([5, 6], tops=tops)), logprobs=2)


@pytest.mark.parametrize("retry_after", ["inf", "1e400", "86400", "99999999"])
def test_a_retry_after_is_honoured_up_to_a_bound(retry_after):
    # asyncio.sleep(inf) never returns: one 503 with 'Retry-After: inf' hung the rollout
    delay = retry_delay(0, 0.5, retry_after)
    assert math.isfinite(delay) and 0 <= delay <= 60


def test_backing_off_waits_at_most_a_minute():
    # max_retries=40 waited 0.5 * 2**39 s before its last try
    assert 0 <= retry_delay(40, 0.5) <= 60


# --- the micro-batcher ---------------------------------------------------------------------------


def test_closing_the_batcher_fails_the_batch_another_loop_has_queued():
    # close() cancelled the executor job of loop B's batch, which ended B's drain task with its
    # request unanswered: it waited forever (here, until wait_for gives up)
    running, release = threading.Event(), threading.Event()

    def generate(requests):
        running.set()
        release.wait(10)
        return [GenerateResult([7], [0.0], [0.0], "length", 0) for _ in requests]

    batcher, got = MicroBatcher(generate), {}

    def submit_on_own_loop(name: str) -> None:
        async def main():
            try:
                got[name] = await asyncio.wait_for(batcher.submit(GenerateRequest([1], SamplingParams())), 20)
            except (Exception, asyncio.CancelledError) as e:
                got[name] = e
        asyncio.run(main())

    a = threading.Thread(target=submit_on_own_loop, args=("A",))
    a.start()
    running.wait(10)
    b = threading.Thread(target=submit_on_own_loop, args=("B",))
    b.start()
    while batcher._pool._work_queue.qsize() == 0 and b.is_alive():  # B's batch queued behind A's
        time.sleep(0.01)
    batcher.close()
    release.set()
    a.join()
    b.join()
    assert got["A"].token_ids == [7]  # the running batch finishes
    assert isinstance(got["B"], PolicyError) and "closed" in str(got["B"])


def test_a_request_after_close_is_a_policy_error(hf):
    hf.close()
    with pytest.raises(PolicyError, match="closed"):  # was the executor's RuntimeError
        asyncio.run(hf.agenerate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2))))


# --- backends that cannot constrain a reply ------------------------------------------------------


def test_the_openai_backend_refuses_a_constrained_request(canned):
    # it sampled freely: a reply outside the admissible list, whose logprobs are not those
    # of the masked distribution the trainer rebuilds for a constrained turn
    req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4), admissible=("go north", "look"))
    with pytest.raises(PolicyError, match="admissible"):
        canned(_answer([5, 6])).generate([req])


def test_the_mock_backend_refuses_a_constrained_request(tokenizer):
    req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4), admissible=("go north", "look"))
    with pytest.raises(PolicyError, match="admissible"):
        MockPolicy(tokenizer, ["jump"]).generate([req])
