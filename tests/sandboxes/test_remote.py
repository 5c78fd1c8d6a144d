"""The sandbox server: bearer token, request size limit, session isolation; and the CLI."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi", reason="the sandbox server needs fastapi")
pytest.importorskip("uvicorn", reason="the sandbox server needs uvicorn")

from agentrl.errors import SandboxDeadError, SandboxError, SandboxUnavailableError  # noqa: E402
from agentrl.sandboxes import LocalSandbox, PythonInterpreter, RemoteSandbox  # noqa: E402
from agentrl.sandboxes.server import bind_socket, create_app  # noqa: E402

pytestmark = pytest.mark.anyio
TOKEN = "s3cret"


@pytest.fixture
def transport():
    return httpx.ASGITransport(app=create_app(LocalSandbox, TOKEN, max_request_bytes=1 << 20))


async def test_wrong_or_missing_token_is_refused(transport):
    box = RemoteSandbox("http://t", "wrong", transport=transport)
    with pytest.raises(SandboxUnavailableError, match="refused the token"):
        await box.run("true")
    await box.close()
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as raw:
        assert (await raw.get("/v1/health")).status_code == 401


async def test_oversized_request_is_refused(transport):
    async with RemoteSandbox("http://t", TOKEN, transport=transport) as box:
        with pytest.raises(SandboxError, match="413"):
            await box.write_file("big.bin", b"x" * (2 << 20))
        await box.write_file("small.bin", b"x" * 1000)  # the session is still fine
        assert len(await box.read_file("small.bin")) == 1000


async def test_sessions_are_isolated(transport):
    async with (
        RemoteSandbox("http://t", TOKEN, transport=transport) as a,
        RemoteSandbox("http://t", TOKEN, transport=transport) as b,
    ):
        await a.write_file("mine.txt", "a-only")
        assert a.session_id != b.session_id
        with pytest.raises(SandboxError):
            await b.read_file("mine.txt")
        assert (await a.run("id -u")).stdout != (await b.run("id -u")).stdout


async def test_closed_session_is_dead_for_the_client(transport):
    box = RemoteSandbox("http://t", TOKEN, transport=transport)
    await box.start()
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as raw:
        assert (await raw.delete(f"/v1/sessions/{box.session_id}")).status_code == 200
    with pytest.raises(SandboxDeadError):
        await box.run("true")
    await box.close()


async def test_remote_refuses_weaker_isolation_than_required(transport):
    box = RemoteSandbox("http://t", TOKEN, transport=transport, require_isolation="container")
    with pytest.raises(SandboxUnavailableError, match="less than the asked 'container'"):
        await box.start()
    await box.close()


async def test_real_server_over_tcp_runs_the_interpreter():
    import uvicorn

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(LocalSandbox, TOKEN), log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        async with RemoteSandbox(f"http://127.0.0.1:{port}", TOKEN) as box:
            assert (await box.run("echo over-tcp")).stdout == "over-tcp\n"
            async with PythonInterpreter(box) as it:
                await it.execute("acc = 20")
                assert (await it.execute("acc + 22")).stdout == "42\n"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


def test_cli_lists_backends_and_requires_a_token():
    from typer.testing import CliRunner

    from agentrl.sandboxes.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["backends"])
    assert listed.exit_code == 0
    assert "local" in listed.output and "none" in listed.output
    refused = runner.invoke(app, ["serve", "--token", ""])
    assert refused.exit_code == 2
    assert "--token" in refused.output
