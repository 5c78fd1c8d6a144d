"""Fixtures for the proxy tests: a proxy over a policy, served by uvicorn on a free port."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentrl.policy import HFPolicy, MockPolicy
from agentrl.proxy import ProxyConfig, RunningServer, create_app


@pytest.fixture
def serve() -> Iterator[Callable[..., RunningServer]]:
    """``serve(policy, **config)`` starts a proxy; every one started is stopped after the test."""
    started: list[RunningServer] = []
    # Server thread and clients share one interpreter: switch the GIL often, or each
    # hand-over waits out the default 5 ms interval.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)

    def start(policy: Any, **config: Any) -> RunningServer:
        server = RunningServer(create_app(policy, ProxyConfig(**config)))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
    sys.setswitchinterval(interval)


@pytest.fixture
def mock_policy(tokenizer) -> Callable[..., MockPolicy]:
    def make(responses: Any = ("Hello there!",)) -> MockPolicy:
        return MockPolicy(tokenizer, responses if callable(responses) else list(responses))
    return make


@pytest.fixture(scope="module")
def hf_server(tiny_model, tokenizer) -> Iterator[RunningServer]:
    """The tiny random Llama behind the proxy (prefix cache off: nothing carries over)."""
    policy = HFPolicy(tiny_model, tokenizer, max_batch_size=8, prefix_cache_mb=0)
    server = RunningServer(create_app(policy, ProxyConfig(max_context_tokens=1024, default_max_tokens=12)))
    yield server
    server.stop()
