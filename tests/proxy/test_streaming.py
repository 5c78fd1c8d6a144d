"""Streaming: chunks leave as tokens are sampled, they spell the recorded reply, and a client
that leaves mid-stream stops its generation and is never written to again."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time

import httpx
import pytest

from agentrl.policy import GenerateResult
from agentrl.policy.base import action_text
from agentrl.proxy.conversation import cut_at_stop
from agentrl.proxy.replies import TextStream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class _Dribble:
    """Reports ``text``'s tokens one at a time through ``on_token``; after the third it waits
    (up to 10 s) until the client has seen a content chunk, then goes on, ``pause_s`` a token."""

    version = 0

    def __init__(self, tokenizer, text: str, pause_s: float = 0.0):
        self.tokenizer, self.pause_s = tokenizer, pause_s
        self.ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
        self.client_saw, self.cancelled = threading.Event(), threading.Event()
        self.streamed_early: bool | None = None

    async def agenerate(self, request) -> GenerateResult:
        try:
            for k, t in enumerate(self.ids):
                request.control.on_token(t)
                if k == 2:
                    deadline = time.monotonic() + 10
                    while not self.client_saw.is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.005)
                    self.streamed_early = self.client_saw.is_set()
                await asyncio.sleep(self.pause_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        n = len(self.ids)
        return GenerateResult(list(self.ids), [-0.5] * n, [1.0] * n, "stop", self.version)


def _events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_chat_chunks_leave_before_the_generation_ends_and_spell_the_recorded_reply(tokenizer, serve):
    text = "Streaming works, token by token: ok."
    policy = _Dribble(tokenizer, text)
    server = serve(policy)
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    events = []
    with httpx.stream("POST", f"{server.url}/sessions/{sid}/v1/chat/completions",
                      json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            events += _events([line])
            if any(c["delta"].get("content") for e in events for c in e["choices"]):
                policy.client_saw.set()
    assert policy.streamed_early  # the first content chunk came while the policy was still sampling
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert content == text
    assert sum(1 for e in events for c in e["choices"] if c["delta"].get("role")) == 1
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == len(policy.ids)
    [node] = httpx.get(f"{server.url}/sessions/{sid}/tree").json()["nodes"]
    assert node["action_ids"] == policy.ids and node["action_text"] == text


def test_completion_stream_with_a_stop_string_sends_nothing_past_it(tokenizer, serve):
    policy = _Dribble(tokenizer, "alpha beta END gamma")
    server = serve(policy)
    body = {"model": "m", "prompt": "x", "stream": True, "stop": ["END"], "max_tokens": 50}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        texts = []
        for line in r.iter_lines():
            for e in _events([line]):
                texts += [c["text"] for c in e["choices"] if c["text"]]
            if texts:
                policy.client_saw.set()
    assert policy.streamed_early and "".join(texts) == "alpha beta "


def test_a_client_that_leaves_mid_stream_cancels_the_generation_and_nothing_is_recorded(tokenizer, serve):
    policy = _Dribble(tokenizer, " ".join(f"w{i}" for i in range(300)), pause_s=0.01)
    server = serve(policy, default_max_tokens=2000)
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    with httpx.stream("POST", f"{server.url}/sessions/{sid}/v1/chat/completions",
                      json={**CHAT, "stream": True}) as r:
        for line in r.iter_lines():
            if '"content": "w' in line or '"content":"w' in line:
                policy.client_saw.set()
                break  # hang up
    assert policy.cancelled.wait(10)
    summary = httpx.get(f"{server.url}/sessions/{sid}").json()
    assert summary["calls"] == [] and "disconnected" in summary["cancelled"][0]["reason"]


def test_a_client_that_leaves_after_the_first_bytes_is_not_written_to_again(mock_policy, serve, caplog):
    """asyncio logs ``socket.send() raised exception.`` for each write to a socket that is gone."""
    text = " ".join(f"word{i}" for i in range(2000))
    server = serve(mock_policy([text]), default_max_tokens=5000, max_context_tokens=8000)
    host, port = server.url[7:].split(":")
    body = json.dumps({**CHAT, "stream": True}).encode()
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, not FIN
        sock.close()
        time.sleep(1.0)
        assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200
    assert [r.getMessage() for r in caplog.records if "socket.send()" in r.getMessage()] == []


@pytest.mark.parametrize(("text", "stops", "keep"), [
    ("Hello wörld, 😀 emoji split across byte tokens 日本語.", (), False),
    ("The answer is 42. STOP and more text", ("STOP",), False),
    ("The answer is 42. STOP and more text", ("STOP", "answer"), True),
    ("ends with a partial st", ("stop!",), False),
])
def test_text_stream_releases_only_prefixes_of_the_finished_text(tokenizer, text, stops, keep):
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    final = cut_at_stop(action_text(tokenizer, ids, stops), stops, keep)
    for step in (1, 3):
        stream, sent = TextStream(tokenizer, stops, keep), ""
        for k in range(0, len(ids), step):
            sent += stream.push(ids[k:k + step])
            assert final.startswith(sent) and sent == stream.sent
        held = max(map(len, stops), default=1) - 1
        assert len(final) - len(sent) <= held  # all but what a stop could still begin with
    assert TextStream(tokenizer).push(tokenizer.encode("😀")[:1]) == ""  # half a character waits


def test_hf_streams_the_same_reply_it_returns_whole(hf_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{hf_server.url}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Tell me something."}]
    for stop in (None, ["e"]):
        whole = client.chat.completions.create(model="m", messages=msgs, max_tokens=24, seed=9, stop=stop)
        chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=24, seed=9,
                                                     stop=stop, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
