"""`agentrl proxy serve` stops in seconds with a call stuck in generation, and writes its sessions."""

import contextlib
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

_SERVE = textwrap.dedent('''
    import asyncio, sys, time
    from agentrl.models import load_tokenizer
    from agentrl.policy.mock import MockPolicy
    from agentrl.proxy import ProxyConfig
    from agentrl.proxy.app import serve

    class Stuck(MockPolicy):
        """The first call answers; every later one is stuck (a long generation)."""
        async def agenerate(self, req):
            self.calls += 1
            if self.calls > 1:
                await asyncio.sleep(600)
            return self.generate([req])[0]

    class StuckThread:
        """A backend without agenerate: the proxy runs its generate on a thread."""
        def __init__(self, inner):
            self.inner, self.tokenizer, self.version, self.calls = inner, inner.tokenizer, 0, 0
        def generate(self, reqs):
            self.calls += 1
            if self.calls > 1:
                time.sleep(600)
            return self.inner.generate(reqs)

    mock = MockPolicy(load_tokenizer("tiny-random"), ["hello"])
    policy = Stuck(mock.tokenizer, ["hello"]) if sys.argv[2] == "agenerate" else StuckThread(mock)
    serve(policy, ProxyConfig(out=sys.argv[1]), port=0)
''')


@pytest.mark.parametrize("kind", ["agenerate", "generate"])
def test_a_stop_with_a_call_stuck_in_generation_ends_in_seconds_and_writes_the_sessions(tmp_path, kind):
    """A SIGTERM waited for the call in flight however long it generated (uvicorn's graceful stop
    has no limit by default), and a backend's generate thread held the exit after that."""
    out = tmp_path / "trees.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(out), kind], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        while "agentrl proxy on" not in banner and proc.poll() is None:
            banner = proc.stdout.readline()
        base = re.search(r"on (http://127\.0\.0\.1:\d+)", banner).group(1)
        with httpx.Client(base_url=base, timeout=30) as c:
            for _ in range(100):
                try:
                    c.get("/health")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            c.post("/sessions", json={"session_id": "a"})
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert c.post("/sessions/a/v1/chat/completions", json=body).status_code == 200
        def call() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the stop ends it
                httpx.post(f"{base}/sessions/a/v1/chat/completions", json=body, timeout=120)

        stuck = threading.Thread(target=call, daemon=True)
        stuck.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        said = proc.communicate(timeout=120)[0]
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert took < 40, said  # 5 s of graceful wait, then the stop; before, it waited for the call
    assert proc.returncode == 143, said
    trees = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["meta"]["closed_by"] for t in trees] == ["shutdown"] and len(trees[0]["nodes"]) == 1
