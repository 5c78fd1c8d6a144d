"""The HTTP plumbing the proxy, the env server and the sandbox server share (``agentrl.httputil``):
one body-size limit, one JSON reader whose every refusal is a 4xx, and no private imports."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from agentrl.httputil import HTTPError, lone_surrogate_field, read_json
from agentrl.proxy import RunningServer
from agentrl.proxy.envserver import EnvServerConfig, create_env_app

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "env-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _chunks(total: int):
    """A body with no content-length, so the limit must be enforced while it streams in."""
    yield b'{"env_id": "'
    for _ in range(total // 1000):
        yield b"y" * 1000
    yield b'"}'


def test_the_env_server_answers_every_unreadable_body_with_a_4xx():
    cfg = EnvServerConfig(token=TOKEN, max_request_bytes=4096)
    with RunningServer(create_env_app(cfg)) as server:
        url = f"{server.url}/envs"
        assert httpx.post(url, content=_chunks(10_000), headers=AUTH).status_code == 413
        deep = b'{"env_id": ' + b"[" * 2000 + b"]" * 2000 + b"}"
        r = httpx.post(url, content=deep, headers=AUTH)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        r = httpx.post(url, content=b'{"env_id": "agentrl/GuessNumber-v0", "options": {"a": "\\udc00"}}',
                       headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "options.a"
        r = httpx.post(url, content=b'{"env_id": "\xff"}', headers=AUTH)
        assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"]


def test_the_sandbox_server_refuses_a_streamed_body_over_its_limit():
    pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")
    from agentrl.sandboxes import LocalSandbox
    from agentrl.sandboxes.server import create_app

    app = create_app(LocalSandbox, "tok", max_request_bytes=4096)
    with RunningServer(app) as server:
        r = httpx.post(f"{server.url}/v1/sessions/x/run", content=_chunks(10_000),
                       headers={"Authorization": "Bearer tok"})
        assert r.status_code == 413 and "4096" in r.json()["detail"]


def test_lone_surrogate_field_names_the_path_and_accepts_pairs():
    assert lone_surrogate_field({"a": [1, {"b": "ok"}, {"c": "x\ud800"}]}) == "a.2.c"
    assert lone_surrogate_field({"k\udfff": 1}) == ""  # a key: the object holding it (here the body)
    assert lone_surrogate_field({"a": "\U0001f600", "b": ["\ud83d\ude00".encode("utf-16", "surrogatepass")
                                                          .decode("utf-16")]}) is None


def test_read_json_turns_every_failure_into_an_http_error():
    class Body(BaseModel):
        n: int

    class Req:
        def __init__(self, raw: bytes):
            self.raw = raw

        async def body(self) -> bytes:
            return self.raw

    import asyncio

    def read(raw: bytes) -> int | str:
        try:
            return asyncio.run(read_json(Req(raw), Body, 100)).n
        except HTTPError as e:
            return f"{e.status} {e.param}"

    assert read(b'{"n": 3}') == 3
    assert read(b'{"n": "x"}') == "400 n"
    assert read(b"[" * 100_000) == "400 None"
    assert read(b'{"n": 1, "s": "\\ud800"}') == "400 s"


def _imported_names(path: Path) -> list[str]:
    """The names each ``from ... import`` in ``path`` imports."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) for a in node.names]


def _private(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("_") and not last.startswith("__")


def test_the_http_servers_import_nothing_private_from_other_modules():
    servers = [*sorted((ROOT / "agentrl" / "proxy").glob("*.py")), ROOT / "sandboxes" / "server.py",
               ROOT / "agentrl" / "httputil.py"]
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in servers for n in _imported_names(p) if _private(n)]
    assert bad == []
