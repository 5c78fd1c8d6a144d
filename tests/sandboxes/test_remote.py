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


def test_cli_lists_backends():
    from typer.testing import CliRunner

    from agentrl.sandboxes import describe_backends
    from agentrl.sandboxes.cli import app

    listed = CliRunner().invoke(app, ["backends"])
    assert listed.exit_code == 0
    lines = {line.split()[0]: line for line in listed.output.splitlines() if line.strip()}
    for name, what in describe_backends().items():
        assert what.split("\n")[0][:40] in lines[name]


def test_cli_serve_requires_a_token_from_a_file_or_the_environment(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from agentrl.sandboxes.cli import app

    runner = CliRunner()
    monkeypatch.delenv("AGENTRL_SANDBOX_TOKEN", raising=False)
    refused = runner.invoke(app, ["serve"])
    assert refused.exit_code == 2
    assert "--token-file" in refused.output
    on_cmdline = runner.invoke(app, ["serve", "--token", "visible-in-proc"])
    assert on_cmdline.exit_code == 2 and "No such option" in on_cmdline.output
    # A token is accepted from a file and from the environment: both reach the next check.
    (tmp_path / "token").write_text("from-a-file\n")
    from_file = runner.invoke(app, ["serve", "--token-file", str(tmp_path / "token"),
                                    "--backend", "remote"])  # fmt: skip
    assert from_file.exit_code == 2 and "only proxy" in from_file.output
    monkeypatch.setenv("AGENTRL_SANDBOX_TOKEN", "from-the-env")
    from_env = runner.invoke(app, ["serve", "--backend", "remote"])
    assert from_env.exit_code == 2 and "only proxy" in from_env.output


def test_cli_help_never_shows_the_token(monkeypatch):
    import importlib

    from typer.testing import CliRunner

    import agentrl.sandboxes.cli as cli

    monkeypatch.setenv("AGENTRL_SANDBOX_TOKEN", "hunter2-secret")
    importlib.reload(cli)  # a default read from the environment at import would show here
    shown = CliRunner().invoke(cli.app, ["serve", "--help"])
    assert shown.exit_code == 0 and "token-file" in shown.output
    assert "hunter2-secret" not in shown.output


async def test_a_run_or_exchange_longer_than_the_clients_timeout_is_waited_for(transport):
    """The client's read timeout (600 s) cut off a run with a longer timeout of its own and
    every interpreter exchange (the server waits up to an hour for a reply line): a snippet
    over 10 minutes lost the kernel. Such calls now wait their own time and a grace."""
    reads: list[tuple[str, float | None]] = []

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            reads.append((request.url.path.rsplit("/", 1)[-1], request.extensions["timeout"]["read"]))
            return await transport.handle_async_request(request)

    box = RemoteSandbox("http://t", TOKEN, timeout=600.0, transport=Recording())
    try:
        assert (await box.run("true", timeout=900.0)).exit_code == 0
        assert (await box.run("true", timeout=5.0)).exit_code == 0
        proc = await box.open_process(["cat"])
        assert await proc.exchange(b"hi\n") == b"hi\n"
        await proc.kill()
    finally:
        await box.close()
    waits = [(path, read) for path, read in reads if path in ("run", "exchange")]
    assert waits == [("run", 960.0), ("run", 600.0), ("exchange", 3660.0)]
