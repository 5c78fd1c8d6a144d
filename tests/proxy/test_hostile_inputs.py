"""Inputs careless clients and real harnesses send, found by a hostile review: each one is answered
with a 4xx in its protocol's own error shape that says what to fix, never a 500 or a quiet
mis-serve, and nothing already recorded is lost.

The app runs in process (starlette's ``TestClient``) over a ``MockPolicy``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from agentrl.policy import MockPolicy
from agentrl.proxy import ProxyConfig, create_app

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": USER}
RESPONSES = {"model": "m", "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 16, "messages": USER}


@pytest.fixture
def client(tokenizer):
    app = create_app(MockPolicy(tokenizer, ["Hello there!"]), ProxyConfig(max_context_tokens=2048))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _openai_error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"], err
    return err["message"]


def _anthropic_error(r: httpx.Response, field: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(field), body
    return body["error"]["message"]


# -- sampling values a backend cannot take ------------------------------------------------
@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 100, -(2 ** 63) - 1])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_seed_outside_64_bits_is_a_400_not_a_backend_crash(client, path, seed):
    # hf's torch.Generator.manual_seed raised OverflowError for the whole batch: a 500 that also
    # failed every request batched with it.
    body = {**CHAT, "prompt": "hi", "seed": seed}
    _openai_error(client.post(path, json=body), "seed")


def test_seeds_in_64_bits_are_served(client):
    for seed in (-(2 ** 63), -5, 2 ** 63 - 1):
        assert client.post("/v1/chat/completions", json={**CHAT, "seed": seed}).status_code == 200


@pytest.mark.parametrize("ids", [[-1], [10 ** 12], [2 ** 70]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(client, ids):
    _openai_error(client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": ids}), "stop_token_ids")


def test_a_top_k_over_the_vocabulary_samples_as_top_k_off(tokenizer):
    """top_k past the vocabulary keeps every token: the backend gets 0 (off), not a number that
    overflows its int32 tensors (vLLM)."""
    seen = _sampled_with(tokenizer, "top_k", [("/v1/chat/completions", {**CHAT, "top_k": 2 ** 70}),
                                              ("/v1/messages", {**MESSAGES, "top_k": 2 ** 40}),
                                              ("/v1/chat/completions", {**CHAT, "top_k": 5})])
    assert seen == [0, 0, 5]


def _sampled_with(tokenizer, param: str, calls: list[tuple[str, dict]]) -> list:
    """The ``SamplingParams.<param>`` the backend got for each call (each must be served)."""
    seen = []

    class Spy(MockPolicy):
        async def agenerate(self, request):
            seen.append(getattr(request.params, param))
            return await super().agenerate(request)

    with TestClient(create_app(Spy(tokenizer, ["Hello there!"]), ProxyConfig())) as c:
        for path, body in calls:
            assert c.post(path, json=body).status_code == 200, body
    return seen


def test_a_temperature_too_small_to_sample_at_is_served_greedy(tokenizer):
    """The backends refuse 0 < t < 1e-5 (vLLM decodes it greedily, so its logprobs would not be
    the ones the trainer scores); the wire APIs take any value from 0, so the proxy sends it as
    0, as vLLM's own server decodes it, instead of a 400."""
    seen = _sampled_with(tokenizer, "temperature", [("/v1/chat/completions", {**CHAT, "temperature": 1e-6}),
                                                    ("/v1/messages", {**MESSAGES, "temperature": 5e-324}),
                                                    ("/v1/responses", {**RESPONSES, "temperature": 1e-5}),
                                                    ("/v1/chat/completions", CHAT)])
    assert seen == [0.0, 0.0, 1e-5, 1.0]


# -- content the proxy cannot serve --------------------------------------------------------
@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_a_chat_image_audio_or_file_part_is_refused_by_name(client, part):
    # was "messages.0.content.str: Input should be a valid string": the str branch of the union
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]}
    message = _openai_error(client.post("/v1/chat/completions", json=body), "messages.0.content")
    assert f"part 1 is of type {part['type']!r}: only text parts" in message


def test_chat_text_parts_are_still_read(client):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


# -- tool choices that name no offered tool ------------------------------------------------
def test_a_named_tool_choice_without_tools_is_a_400_in_every_protocol(client):
    # Chat Completions refused it; Responses and Messages dropped the choice and answered in text.
    _openai_error(client.post("/v1/chat/completions", json={
        **CHAT, "tool_choice": {"type": "function", "function": {"name": "add"}}}), "tool_choice")
    _openai_error(client.post("/v1/responses", json={
        **RESPONSES, "tool_choice": {"type": "function", "name": "add"}}), "tool_choice")
    _openai_error(client.post("/v1/responses", json={
        **RESPONSES, "tools": [{"type": "web_search"}], "tool_choice": {"type": "function", "name": "add"}}),
        "tool_choice")
    _anthropic_error(client.post("/v1/messages", json={
        **MESSAGES, "tool_choice": {"type": "tool", "name": "add"}}), "tool_choice")


def test_auto_or_none_tool_choice_without_tools_is_still_served(client):
    assert client.post("/v1/responses", json={**RESPONSES, "tools": [{"type": "web_search"}],
                                              "tool_choice": "auto"}).status_code == 200
    assert client.post("/v1/messages", json={**MESSAGES, "tool_choice": {"type": "auto"}}).status_code == 200
    assert client.post("/v1/messages", json={**MESSAGES, "tool_choice": {"type": "none"}}).status_code == 200


# -- requests whose meaning the proxy cannot honour ----------------------------------------
@pytest.mark.parametrize(("field", "value"), [("conversation", "conv_123"), ("conversation", {"id": "conv_1"}),
                                              ("prompt", {"id": "pmpt_1", "version": "2"})])
def test_responses_state_the_proxy_does_not_keep_is_refused(client, field, value):
    """A stored conversation or prompt template would be put before the input: dropped, the model
    answered without it."""
    _openai_error(client.post("/v1/responses", json={**RESPONSES, field: value}), field)


def test_responses_without_conversation_or_prompt_are_served(client):
    assert client.post("/v1/responses", json={**RESPONSES, "conversation": None, "prompt": None}).status_code == 200


# -- a session closed while one of its calls generates --------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_in_flight_when_its_session_closes_is_refused_not_recorded_after_the_close(
        tokenizer, serve, tmp_path, stream):
    """Its tree was written to ``out`` at the close: a call recorded afterwards never reached it,
    yet the harness was told it succeeded (and the closed tree changed under its reader)."""
    class Slow(MockPolicy):  # streams its first tokens live (as hf does), then waits
        async def agenerate(self, request):
            result = await super().agenerate(request)
            for t in result.token_ids[:2]:
                if request.control.on_token is not None:
                    request.control.on_token(t)
            await asyncio.sleep(0.6)
            return result

    out = tmp_path / "trees.jsonl"
    server = serve(Slow(tokenizer, ["Hello there!"]), out=str(out))
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    done = {}

    def call() -> None:
        done["r"] = httpx.post(f"{server.url}/sessions/{sid}/v1/chat/completions",
                               json={**CHAT, "stream": stream}, timeout=30)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.2)
    closed = httpx.post(f"{server.url}/sessions/{sid}/close").json()
    t.join()
    r = done["r"]
    if stream:  # the first chunks went out: the refusal is the stream's last event
        assert r.status_code == 200 and "chat.completion.chunk" in r.text, r.text
        assert '"error"' in r.text and "closed while this call was generating" in r.text, r.text
    else:
        assert r.status_code == 409 and "closed" in r.json()["error"]["message"], r.text
    again = httpx.post(f"{server.url}/sessions/{sid}/close").json()
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert closed["meta"]["calls"] == again["meta"]["calls"] == written[0]["meta"]["calls"] == 0
    assert again["nodes"] == written[0]["nodes"] == []


# -- routes the proxy does not have ------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/chat/completions", 405), ("POST", "/v1/embeddings", 404), ("GET", "/v1/responses/resp_1", 404),
    ("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404), ("POST", "/sessions/s/v1/audio", 404)])
def test_a_route_or_method_the_proxy_lacks_is_answered_in_its_protocols_error_shape(client, method, path, status):
    # was starlette's text/plain "Not Found" / "Method Not Allowed"
    r = client.request(method, path)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    body = r.json()
    if "/v1/messages" in path:
        assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "api_error"), body
        assert path in body["error"]["message"]
    else:
        assert path in body["error"]["message"] and body["error"]["type"] == "invalid_request_error", body


# -- where a field takes several shapes, the error names the client's --------------------
def test_a_bad_value_inside_a_list_is_named_where_it_is_not_as_the_string_it_might_have_been(client):
    # pydantic tries a string first: a part with a numeric text read "content.str: Input should
    # be a valid string", a function call's object arguments "input.str: ..."
    part = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    msg = _openai_error(client.post("/v1/chat/completions", json={**CHAT, "messages": part}),
                        "messages.0.content.0.text")
    assert ".str" not in msg and "list[" not in msg
    call = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}]
    _openai_error(client.post("/v1/responses", json={**RESPONSES, "input": call}), "input.0.arguments")
    msg = _anthropic_error(client.post("/v1/messages", json={**MESSAGES, "messages": part}),
                           "messages.0.content.0.text")
    assert ".str" not in msg
    # failures at one depth are the shapes it might have had, all named
    msg = _openai_error(client.post("/v1/chat/completions", json={**CHAT, "stop": 5}), "stop")
    assert "valid string or" in msg and "valid list" in msg


def test_auto_created_sessions_take_the_ids_post_sessions_takes(tokenizer):
    """Any path segment or x-session-id header opened a session (a 4 KB id, spaces, unicode),
    though POST /sessions refuses such ids."""
    app = create_app(MockPolicy(tokenizer, ["Hello there!"]), ProxyConfig(auto_create_sessions=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        for bad in ("x" * 129, "a b", "a/../b"):
            r = c.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": bad})
            assert r.status_code == 400 and "not a valid id" in r.json()["error"]["message"], r.text
        for bad in ("x" * 200, "süß", "run-1%0A"):  # %0A: a newline, which a $ anchor lets through
            r = c.post(f"/sessions/{bad}/v1/chat/completions", json=CHAT)
            assert r.status_code == 400, r.text
        assert c.get("/sessions").json()["sessions"] == []
        assert c.post("/sessions/run-1.a_b/v1/chat/completions", json=CHAT).status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "h-2"}).status_code == 200
        assert sorted(s["session_id"] for s in c.get("/sessions").json()["sessions"]) == ["h-2", "run-1.a_b"]
