"""Fifty sessions from separate client tasks at once: each tree holds only its own calls."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the concurrency test drives the proxy with AsyncOpenAI")

SESSIONS, TURNS = 50, 3


def _echo(prompt: str) -> str:
    """Answer with the last user message, so every reply names its session and turn."""
    return "echo: " + re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.DOTALL)[-1]


def test_fifty_concurrent_sessions_do_not_cross_talk(mock_policy, serve):
    server = serve(mock_policy(_echo))

    async def harness(i: int, http: httpx.AsyncClient) -> str:
        data = (await http.post(f"{server.url}/sessions", json={"meta": {"i": i}})).json()
        client = openai.AsyncOpenAI(base_url=data["base_url"], api_key=data["api_key"], max_retries=0,
                                    http_client=http)  # one pool: building 50 TLS contexts costs seconds
        msgs = [{"role": "system", "content": f"agent {i}"}]
        for t in range(TURNS):
            msgs.append({"role": "user", "content": f"session {i} turn {t}"})
            out = await client.chat.completions.create(model="m", messages=msgs, stream=(t == 1))
            if t == 1:
                text = "".join([c.choices[0].delta.content or "" async for c in out if c.choices])
            else:
                text = out.choices[0].message.content
            assert text == f"echo: session {i} turn {t}"
            msgs.append({"role": "assistant", "content": text})
            await asyncio.sleep(0)
        return data["session_id"]

    async def run() -> list[str]:
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(harness(i, http) for i in range(SESSIONS)))

    sids = asyncio.run(run())
    for i, sid in enumerate(sids):
        tree = httpx.get(f"{server.url}/sessions/{sid}/tree").json()
        assert tree["meta"]["i"] == i and tree["meta"]["branches"] == []
        texts = [n["action_text"] for n in tree["nodes"]]
        assert texts == [f"echo: session {i} turn {t}" for t in range(TURNS)]
        assert [n["parent"] for n in tree["nodes"]] == [None, 0, 1]


class _SyncOnly:
    """A backend with ``generate`` only (no ``agenerate``), not safe to call from two threads: it
    counts the calls running at once. Each call runs until its requests are cancelled (or 2 s)."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.running = self.most = 0
        self.lock = threading.Lock()
        self.first_in = threading.Event()

    def generate(self, requests):
        from agentrl.policy import GenerateResult

        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.first_in.set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not all(r.control.cancelled for r in requests):
            time.sleep(0.01)
        time.sleep(0.3)  # a backend notices a cancel at its next step, not at once
        with self.lock:
            self.running -= 1
        ids = [self.tokenizer.eos_token_id]
        return [GenerateResult(ids, [-0.5], [0.0], "stop", 0) for _ in requests]


def test_a_backend_without_agenerate_runs_one_call_at_a_time_even_after_a_cancel(tokenizer, serve):
    """A client that leaves cancels its call, but the backend's thread runs on until it notices:
    the next call waits for it, not only for the cancel."""
    policy = _SyncOnly(tokenizer)
    server = serve(policy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    assert policy.first_in.is_set()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=10)
    assert r.status_code == 200, r.text
    assert policy.most == 1
