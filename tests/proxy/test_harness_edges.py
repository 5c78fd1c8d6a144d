"""Harness episodes at their edges: what one episode shares with another, what outlives the
trainer, and the proxy's count endpoints under bodies too long to fit."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("path, body", [
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "a" * 2_000_000}]}),
    ("/v1/responses/input_tokens", {"model": "m", "input": "a" * 2_000_000}),
])
def test_a_count_of_a_prompt_too_long_to_fit_is_refused_before_it_is_rendered(mock_policy, serve, monkeypatch,
                                                                              path, body):
    """The count endpoints rendered and tokenized any body up to the 8 MB limit (a thread held for
    seconds per call) without the check the sampling endpoints make first: 2,000,000 characters
    are at least 2,000,000 / (most bytes a token holds) tokens, far over a budget of 4096."""
    import agentrl.proxy.handlers as handlers

    def never(*a, **kw):
        raise AssertionError("rendered a prompt that cannot fit")

    monkeypatch.setattr(handlers, "_render_whole", never)
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "the prompt is at least" in error["message"] and "over the context budget of 4096" in error["message"]


def test_a_count_that_fits_is_still_counted(mock_policy, serve):
    server = serve(mock_policy(), max_context_tokens=4096)
    r = httpx.post(f"{server.url}/v1/messages/count_tokens",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
