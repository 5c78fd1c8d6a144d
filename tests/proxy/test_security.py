"""Access control and bad input: every error is answered, with the right code, and the server goes on."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from agentrl.errors import PolicyError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_token_guards_every_route_and_keys_stay_in_their_session(mock_policy, serve):
    server = serve(mock_policy(), token="s3cret")
    url, admin = server.url, {"Authorization": "Bearer s3cret"}
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/sessions"),
                         ("GET", "/sessions")]:
        assert httpx.request(method, url + path, json=CHAT).status_code == 401
        assert httpx.request(method, url + path, json=CHAT,
                             headers={"Authorization": "Bearer s3cre"}).status_code == 401
    a = httpx.post(f"{url}/sessions", json={}, headers=admin).json()
    b = httpx.post(f"{url}/sessions", json={}, headers=admin).json()
    key_a = {"Authorization": f"Bearer {a['api_key']}"}
    assert httpx.post(f"{a['base_url']}/chat/completions", json=CHAT, headers=key_a).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=key_a).status_code == 200
    assert httpx.get(f"{url}/sessions/{a['session_id']}/tree", headers=key_a).status_code == 200
    # key A cannot touch session B, by URL or by header, nor use the admin routes
    assert httpx.post(f"{b['base_url']}/chat/completions", json=CHAT, headers=key_a).status_code == 403
    assert httpx.get(f"{url}/sessions/{b['session_id']}/tree", headers=key_a).status_code == 403
    assert httpx.post(f"{url}/sessions/{b['session_id']}/close", headers=key_a).status_code == 403
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                      headers={**key_a, "X-Session-Id": b["session_id"]}).status_code == 403
    assert httpx.post(f"{url}/sessions", json={}, headers=key_a).status_code == 403
    assert httpx.get(f"{url}/sessions", headers=key_a).status_code == 403
    assert httpx.get(f"{url}/sessions/{b['session_id']}", headers=admin).json()["calls"] == []
    assert httpx.get(f"{url}/sessions/nope/tree", headers=admin).status_code == 404


def test_key_of_another_session_is_refused_even_without_a_token(mock_policy, serve):
    server = serve(mock_policy())
    a = httpx.post(f"{server.url}/sessions", json={}).json()
    b = httpx.post(f"{server.url}/sessions", json={}).json()
    r = httpx.post(f"{b['base_url']}/chat/completions", json=CHAT,
                   headers={"Authorization": f"Bearer {a['api_key']}"})
    assert r.status_code == 403 and "another session" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "messages": []}, "messages"),
    ({**CHAT, "temperature": 5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 99}, "n"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "presence_penalty": 0.5}, "presence_penalty"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": "m", "prompt": []}, "prompt"),
])
def test_schema_errors_are_400_naming_the_field(mock_policy, serve, body, field):
    server = serve(mock_policy())
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)


def test_invalid_json_oversized_body_and_unknown_session(mock_policy, serve):
    server = serve(mock_policy(), max_request_bytes=2048)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=big).status_code == 413

    def chunks():  # no content-length: refused while streaming in
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    assert httpx.post(f"{server.url}/v1/chat/completions", content=chunks()).status_code == 413
    r = httpx.post(f"{server.url}/sessions/ghost/v1/chat/completions", json=CHAT)
    assert r.status_code == 404 and "ghost" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200  # still up


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a" * 2_000_000}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "é" * 600_000}, {"type": "text", "text": "x"}]}]}),
    ("/v1/responses", {"model": "m", "input": "a" * 2_000_000}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a" * 2_000_000}]}),
])
def test_a_prompt_too_long_to_fit_is_refused_before_it_is_rendered(mock_policy, serve, monkeypatch, path, body):
    """A 7 MB body was rendered and tokenized on the event loop (7-10 s, every session and
    stream stalled) before the budget's 400. Text that no tokenization could fit is refused
    from its byte count: the template is never rendered."""
    import agentrl.proxy.handlers as handlers

    def never(*a, **kw):
        raise AssertionError("rendered a prompt that cannot fit")

    monkeypatch.setattr(handlers, "render_plan", never)
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "the prompt is at least" in message and "over the context budget of 4096" in message


def test_prompt_over_the_context_budget_is_400(mock_policy, serve):
    server = serve(mock_policy(), max_context_tokens=64)
    long = {"model": "m", "messages": [{"role": "user", "content": "word " * 200}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=long)
    assert r.status_code == 400 and "context budget" in r.json()["error"]["message"]
    strict = serve(mock_policy(), max_context_tokens=64, clamp_max_tokens=False)
    r = httpx.post(f"{strict.url}/v1/chat/completions", json={**CHAT, "max_tokens": 60})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_max_tokens_over_the_room_left_is_lowered_to_it(mock_policy, serve, tokenizer):
    """Harnesses ask for 32k-64k tokens of any model: the reply gets the room the prompt leaves,
    and, since the harness's own limit was not reached, it is reported as ended; the session's
    node keeps the truth (``length``)."""
    server = serve(mock_policy(["word " * 100]), max_context_tokens=64)
    s = httpx.post(f"{server.url}/sessions").json()
    r = httpx.post(f"{s['base_url']}/chat/completions", headers={"Authorization": f"Bearer {s['api_key']}"},
                   json={**CHAT, "max_tokens": 64000, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt, sampled = len(body["prompt_token_ids"]), len(body["choices"][0]["token_ids"])
    assert prompt + sampled == 64 and body["choices"][0]["finish_reason"] == "stop"
    tree = httpx.post(f"{server.url}/sessions/{s['session_id']}/close").json()
    assert [n["finish_reason"] for n in tree["nodes"]] == ["length"]
    # Its own limit reached: cut short, as the harness asked.
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    assert r.json()["choices"][0]["finish_reason"] == "length"


class _DownPolicy:
    version = 3

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def agenerate(self, request):
        raise PolicyError("connection refused by the inference server")


def test_backend_down_is_503_with_retry_after(tokenizer, serve):
    server = serve(_DownPolicy(tokenizer), retry_after_s=7)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.headers["x-policy-version"] == "3"
    assert "connection refused" in r.json()["error"]["message"]


class _SlowPolicy:
    """Hangs in agenerate until cancelled; says when it started and when it was cancelled."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.started, self.cancelled = threading.Event(), threading.Event()

    async def agenerate(self, request):
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_client_leaving_mid_generation_cancels_it(tokenizer, serve):
    policy = _SlowPolicy(tokenizer)
    server = serve(policy)
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert policy.started.wait(10)
    assert policy.cancelled.wait(10)
    deadline = time.monotonic() + 5
    while not (cancelled := httpx.get(f"{server.url}/sessions/{sid}").json()["cancelled"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "disconnected" in cancelled[0]["reason"]


def test_client_leaving_mid_stream_loses_nothing(mock_policy, serve, tokenizer):
    text = " ".join(f"word{i}" for i in range(200))
    server = serve(mock_policy([text]), default_max_tokens=1000)
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    with httpx.stream("POST", f"{server.url}/sessions/{sid}/v1/chat/completions",
                      json={**CHAT, "stream": True}) as r:
        next(r.iter_lines())  # one event, then hang up
    tree = httpx.get(f"{server.url}/sessions/{sid}/tree").json()
    [node] = tree["nodes"]
    assert node["action_ids"] == tokenizer.encode(text) + [tokenizer.eos_token_id]


def test_json_nested_past_the_parser_limit_is_400_not_500(mock_policy, serve):
    server = serve(mock_policy())
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{server.url}/v1/chat/completions", content=deep)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    # tool-call arguments are JSON inside a string: past the limit they are kept as text
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 2000}}]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": msgs})
    assert r.status_code == 200, r.text


_LONE = '"a\\ud800b"'  # JSON text: a high surrogate with no low one after it


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": %s}]}', "messages.0.content"),
    ("/v1/completions", '{"model": "m", "prompt": %s}', "prompt"),
    ("/sessions", '{"meta": {"k": %s}}', "meta.k"),
])
def test_a_lone_surrogate_is_400_naming_the_field(mock_policy, serve, path, body, field):
    server = serve(mock_policy())
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    paths = [path] if path == "/sessions" else [path, f"/sessions/{sid}{path}"]
    for p in paths:
        r = httpx.post(server.url + p, content=(body % _LONE).encode())
        assert r.status_code == 400, (p, r.text)
        assert r.json()["error"]["param"] == field and "surrogate" in r.json()["error"]["message"]
    # a surrogate pair is one valid character: accepted
    pair = body % '"a\\ud83d\\ude00b"'
    assert httpx.post(server.url + path, content=pair.encode()).status_code == 200
    assert httpx.get(f"{server.url}/sessions/{sid}/tree").status_code == 200


def test_a_close_that_cannot_write_keeps_the_session_open_and_the_next_close_writes(mock_policy, serve,
                                                                                      tmp_path):
    out = tmp_path / "later" / "trees.jsonl"  # the folder does not exist yet: the write fails
    server = serve(mock_policy(["a", "b"]), out=str(out))
    sid = httpx.post(f"{server.url}/sessions", json={"meta": {"task": 1}}).json()["session_id"]
    url = f"{server.url}/sessions/{sid}"
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200
    r = httpx.post(f"{url}/close")
    assert r.status_code == 500 and "close it again" in r.json()["error"]["message"]
    assert httpx.get(url).json()["closed"] is False  # nothing was marked: it still records
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200
    out.parent.mkdir()
    closed = httpx.post(f"{url}/close")
    assert closed.status_code == 200 and len(closed.json()["nodes"]) == 2
    assert httpx.post(f"{url}/close").status_code == 200  # a second close does not write again
    from agentrl.types import read_trees

    [saved] = read_trees(out)
    assert saved.to_dict() == closed.json() and saved.meta["task"] == 1
