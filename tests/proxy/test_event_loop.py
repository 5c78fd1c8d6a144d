"""The proxy's event loop, which every session and stream shares, stays free while a long prompt
is rendered and tokenized."""

from __future__ import annotations

import threading

import httpx

_LONG = "word " * 12_000  # 60,000 characters: about 0.3 s to tokenize, 12,000 tokens


def test_long_prompts_are_rendered_off_the_event_loop(mock_policy, serve, tokenizer, monkeypatch):
    """A history that fits a large budget was rendered and tokenized on the loop: about a second
    a megabyte during which no other session or stream moved."""
    server = serve(mock_policy(["ok"]), max_context_tokens=32768, default_max_tokens=4)
    on_loop: list[str] = []

    def spy(name):
        real = getattr(tokenizer, name)

        def call(*a, **k):
            text = a[0] if a else k.get("conversation")
            size = len(text) if isinstance(text, str) else sum(len(str(m.get("content", ""))) for m in text)
            if size > len(_LONG) and threading.current_thread() is server.thread:
                on_loop.append(name)
            return real(*a, **k)
        monkeypatch.setattr(tokenizer, name, call)

    spy("encode")
    spy("apply_chat_template")
    sid = httpx.post(f"{server.url}/sessions", json={}).raise_for_status().json()["session_id"]
    first = [{"role": "user", "content": "Read this. " + _LONG}]
    with httpx.Client(base_url=f"{server.url}/sessions/{sid}/v1", timeout=60) as c:
        r = c.post("/chat/completions", json={"model": "m", "messages": first})
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]
        # The next call goes on from the recorded one: only its new, long message is tokenized.
        r = c.post("/chat/completions", json={"model": "m", "messages": [
            *first, reply, {"role": "user", "content": "More. " + _LONG}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 12_000  # it did go on
    plain = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": first}, timeout=60)
    assert plain.status_code == 200, plain.text
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": _LONG}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 12_000, counted.text
    assert on_loop == []
