"""Fifty sessions from separate client tasks at once: each tree holds only its own calls."""

from __future__ import annotations

import asyncio
import re

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
