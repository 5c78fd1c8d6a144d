"""CLI smoke tests: the proxy and env commands are mounted; env serve refuses to run without a token."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import agentrl.proxy.cli as proxy_cli
from agentrl.cli import _mount_plugins, app


def test_proxy_and_env_commands_are_mounted_and_env_needs_a_token(monkeypatch):
    _mount_plugins()
    runner = CliRunner()
    out = runner.invoke(app, ["proxy", "serve", "--help"])
    assert out.exit_code == 0 and "--token-file" in out.output
    monkeypatch.delenv("AGENTRL_ENV_TOKEN", raising=False)
    out = runner.invoke(app, ["env", "serve"])
    assert out.exit_code == 2 and "token is required" in out.output


def test_proxy_serve_banner_names_the_session_url_a_harness_needs(monkeypatch):
    import gc
    import socket

    import uvicorn

    import agentrl.httputil as httputil
    import agentrl.proxy.app as proxy_app

    bound = socket.socket()  # bound, never served: the banner only
    bound.bind(("127.0.0.1", 0))
    port = bound.getsockname()[1]  # --port 0 asks for any port: the banner names the one it got
    monkeypatch.setattr(httputil, "listen_socket", lambda host, port, **kw: bound)
    monkeypatch.setattr(proxy_app, "listen_socket", lambda host, port, **kw: bound)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    _mount_plugins()
    try:
        out = CliRunner().invoke(app, ["proxy", "serve", "--backend", "mock", "--port", "0"])
    finally:
        gc.unfreeze()  # serve freezes what is loaded, for a long-lived server
        bound.close()
    assert out.exit_code == 0, out.output
    assert f"OPENAI_BASE_URL: http://127.0.0.1:{port}/sessions/<id>/v1" in out.output
    assert f"ANTHROPIC_BASE_URL (Claude Code, anthropic SDKs): http://127.0.0.1:{port}/sessions/<id>" in out.output
    assert f"POST http://127.0.0.1:{port}/sessions" in out.output


def test_env_serve_on_port_0_says_the_port_it_got(monkeypatch):
    monkeypatch.setenv("AGENTRL_ENV_TOKEN", "t0ken")
    out, port = _env_serve_on_port_0(monkeypatch, lambda self, sockets=None: None)
    assert out.exit_code == 0, out.output
    assert f"agentrl env server on http://127.0.0.1:{port}\n" in out.output  # not :0


def test_env_serve_imports_the_modules_of_a_users_envs_first(monkeypatch, tmp_path):
    """A user's env, registered by their own module, could be served only by naming the module in
    every client's env id ('module:myorg/Name-v0'); --import registers it before the server starts."""
    import sys

    from agentrl.env import make_env

    (tmp_path / "my_serve_envs.py").write_text(
        "from agentrl.envs.guess_number import GuessNumberEnv\n"
        "from agentrl.env import register_env\n"
        "register_env('myorg/ServedGuess-v0', entry_point=GuessNumberEnv)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AGENTRL_ENV_TOKEN", "t0ken")
    made = []
    out, _ = _env_serve_on_port_0(monkeypatch, lambda self, sockets=None: made.append(make_env("myorg/ServedGuess-v0")),
                                  "--import", "my_serve_envs")
    assert out.exit_code == 0, out.output
    assert "my_serve_envs" in sys.modules and len(made) == 1
    out, _ = _env_serve_on_port_0(monkeypatch, lambda self, sockets=None: None, "--import", "no_such_env_module")
    assert out.exit_code == 2 and "cannot import env module 'no_such_env_module'" in out.output, out.output


def _env_serve_on_port_0(monkeypatch, run, *extra: str):
    """``agentrl env serve --port 0`` on a bound socket, with ``run`` as uvicorn's ``Server.run``."""
    import socket

    import uvicorn

    import agentrl.proxy.envserver as envserver

    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    monkeypatch.setattr(envserver, "listen_socket", lambda host, port, **kw: bound)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    _mount_plugins()
    try:
        return CliRunner().invoke(app, ["env", "serve", "--port", "0", *extra]), bound.getsockname()[1]
    finally:
        bound.close()


def test_a_port_in_use_fails_with_the_reason_before_anything_says_it_serves(monkeypatch):
    import gc
    import socket

    monkeypatch.setenv("AGENTRL_ENV_TOKEN", "t0ken")
    _mount_plugins()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for cmd in (["proxy", "serve", "--backend", "mock"], ["env", "serve"]):
            try:
                out = CliRunner().invoke(app, [*cmd, "--port", str(port)])
            finally:
                gc.unfreeze()
            assert out.exit_code == 2, out.output
            assert f"cannot listen on 127.0.0.1:{port}: another process holds the port" in out.output
            assert "http://127.0.0.1" not in out.output  # no banner for a server that never ran


def test_a_port_another_socket_bound_but_does_not_listen_on_yet_is_refused_too():
    """Two servers started at once both bind (SO_REUSEADDR); the second must fail at once, with
    the reason, not later inside uvicorn: listen_socket listens."""
    from agentrl.errors import ConfigError
    from agentrl.httputil import listen_socket

    first = listen_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        try:
            listen_socket("127.0.0.1", port).close()
        except ConfigError as e:
            assert "another process holds the port" in str(e)
        else:
            raise AssertionError("a second server listened on a port the first listens on")
        with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1:70000: .*65535"):
            listen_socket("127.0.0.1", 70000)
    finally:
        first.close()


def test_serve_refuses_an_out_it_cannot_append_to_and_a_tiny_context_before_serving(tmp_path):
    """Both failed late: --out at the first closed session (a 500), the context as a raw traceback."""
    import gc

    _mount_plugins()
    try:
        out = CliRunner().invoke(app, ["proxy", "serve", "--backend", "mock", "--port", "0", "--out", str(tmp_path)])
        assert out.exit_code == 2 and f"--out {tmp_path}: cannot append to it" in out.output, out.output
        fifo = tmp_path / "sessions.jsonl"
        os.mkfifo(fifo)  # opening it to append would wait for a reader
        out = CliRunner().invoke(app, ["proxy", "serve", "--backend", "mock", "--port", "0", "--out", str(fifo)])
        assert out.exit_code == 2 and "not a regular file" in out.output, out.output
        assert proxy_cli._check_appendable(Path(os.devnull)) is None  # a character device appends at once
        out = CliRunner().invoke(app, ["proxy", "serve", "--backend", "mock", "--max-context-tokens", "0"])
        assert out.exit_code == 2 and "Invalid value for '--max-context-tokens'" in out.output, out.output
    finally:
        gc.unfreeze()


def test_proxy_serve_takes_the_configs_context_budget_unless_the_flag_gives_one(monkeypatch, tmp_path):
    """One config for every command: --config's rollout.max_context_tokens (the budget the run
    trains within) was ignored, and the proxy served 4096 whatever it said."""
    import gc

    import agentrl.proxy.app as proxy_app

    got = []
    monkeypatch.setattr(proxy_app, "serve", lambda policy, cfg, *a, **k: got.append(cfg.max_context_tokens))
    config = tmp_path / "run.yaml"
    config.write_text("rollout:\n  max_context_tokens: 1536\n")
    _mount_plugins()
    try:
        for extra, budget in (([], 4096), (["--config", str(config)], 1536),
                              (["--set", "rollout.max_context_tokens=2500"], 2500),
                              (["--config", str(config), "--max-context-tokens", "3000"], 3000)):
            out = CliRunner().invoke(app, ["proxy", "serve", "--backend", "mock", "--port", "0", *extra])
            assert out.exit_code == 0, out.output
            assert got.pop() == budget, extra
    finally:
        gc.unfreeze()


def test_servers_refuse_ports_and_sizes_out_of_range_by_the_option(monkeypatch):
    """A port past 65535 was a raw OverflowError (view), max-envs 0 a raw ValidationError."""
    monkeypatch.setenv("AGENTRL_ENV_TOKEN", "t0ken")
    _mount_plugins()
    for cmd, option in ((["env", "serve", "--max-envs", "0"], "--max-envs"),
                        (["env", "serve", "--port", "70000"], "--port"),
                        (["proxy", "serve", "--backend", "mock", "--port", "-1"], "--port"),
                        (["view", ".", "--port", "70000"], "--port")):
        out = CliRunner().invoke(app, cmd)
        assert out.exit_code == 2 and f"Invalid value for '{option}'" in out.output, (cmd, out.output)


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_stopped_proxy_writes_its_open_sessions_to_out(tmp_path, stop):
    """Ctrl-C on `agentrl proxy serve` lost every session no harness had closed: what they
    recorded lived only in memory. Now each open session with a call is written at shutdown,
    marked closed_by: shutdown; a closed one is not written twice, an empty one not at all.
    SIGTERM too (how a service manager stops it): uvicorn raised it again after its graceful
    shutdown, and its default action ended the process before the sessions were written."""
    import json
    import re
    import signal
    import subprocess
    import sys

    import httpx

    out = tmp_path / "trees.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "proxy", "serve", "--backend", "mock", "--port", "0", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's & ignores SIGINT
    try:
        banner = ""
        while "agentrl proxy on" not in banner and proc.poll() is None:  # after "loading model ..."
            banner = proc.stdout.readline()
        base = re.search(r"on (http://127\.0\.0\.1:\d+)", banner).group(1)
        with httpx.Client(base_url=base, timeout=30) as c:
            for _ in range(100):  # the banner comes before uvicorn accepts
                try:
                    c.get("/health")
                    break
                except httpx.TransportError:
                    threading_wait(0.1)
            ids = [c.post("/sessions", json={"session_id": sid}).json()["session_id"] for sid in ("a", "b", "c")]
            for sid in ids[:2]:
                r = c.post(f"/sessions/{sid}/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
            assert c.post("/sessions/b/close").status_code == 200
        proc.send_signal(getattr(signal, stop))
        said = proc.communicate(timeout=60)[0]
        assert stop == "SIGINT" or proc.returncode == 143, (proc.returncode, said)  # 128 + SIGTERM
    finally:
        proc.kill()
    trees = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(t["meta"]["session_id"], t["meta"].get("closed_by")) for t in trees] == [("b", None), ("a", "shutdown")]
    assert len(trees[1]["nodes"]) == 1 and trees[1]["meta"]["calls"] == 1
    assert f"wrote 1 open session(s) to {out}" in said


def threading_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)


def test_a_stopped_env_server_closes_the_envs_still_open(monkeypatch):
    """`agentrl env serve` stopped with envs open left them unclosed: an env holding a
    sandbox container or a browser outlived the server. Now each is closed at the stop,
    and one whose close hangs is left behind with a warning, not waited on forever."""
    import threading
    from types import SimpleNamespace

    import agentrl.proxy.envserver as envserver

    closed, release = [], threading.Event()

    class Env:
        def __init__(self, name: str, hang: bool = False):
            self.name, self.hang = name, hang

        def close(self) -> None:
            if self.hang:
                release.wait(30)
            closed.append(self.name)

    def serve_then_stop(self, sockets=None):  # the server ran; envs were made; then Ctrl-C
        self.config.app.state.envs.update(a=SimpleNamespace(env=Env("a")), b=SimpleNamespace(env=Env("b")))

    monkeypatch.setenv("AGENTRL_ENV_TOKEN", "t0ken")
    out, _ = _env_serve_on_port_0(monkeypatch, serve_then_stop)
    assert out.exit_code == 0, out.output
    assert sorted(closed) == ["a", "b"]
    closed.clear()
    envs = {"ok": SimpleNamespace(env=Env("ok")), "stuck": SimpleNamespace(env=Env("stuck", hang=True))}
    assert envserver.close_live_envs(envs, wait_s=0.2) == 1 and closed == ["ok"] and envs == {}
    release.set()


def test_a_stopped_proxy_that_cannot_write_its_open_sessions_says_so(tmp_path, monkeypatch):
    """--out was appendable at the start; at the stop its folder is gone. Writing the open
    sessions raised out of the shutdown: a FileNotFoundError traceback, exit code 1. Now it
    says which sessions were lost and why, and the server stops as asked."""
    import gc
    import shutil

    import uvicorn
    from starlette.testclient import TestClient

    out = tmp_path / "gone" / "trees.jsonl"

    def serve_then_stop(self, sockets=None):  # a harness records a call, its --out goes, then Ctrl-C
        with TestClient(self.config.app) as c:
            c.post("/sessions", json={"session_id": "a"})
            r = c.post("/sessions/a/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        shutil.rmtree(out.parent)

    monkeypatch.setattr(uvicorn.Server, "run", serve_then_stop)
    _mount_plugins()
    try:
        res = CliRunner().invoke(app, ["proxy", "serve", "--backend", "mock", "--port", "0", "--out", str(out)])
    finally:
        gc.unfreeze()  # serve freezes what is loaded, for a long-lived server
    assert res.exit_code == 0, (res.output, res.exception)
    assert f"could not write 1 open session(s) to {out}" in res.output
    assert not out.exists()


def test_env_serve_stops_within_seconds_while_an_env_step_is_stuck(tmp_path):
    """A stop waited for a stuck env step up to step_timeout_s (300 s): uvicorn's graceful
    shutdown waits for requests in flight. Now it waits a few seconds, then the envs close."""
    import re
    import signal
    import subprocess
    import sys
    import threading
    import time

    import httpx

    (tmp_path / "stuck_step_envs.py").write_text(
        "import time\nfrom agentrl.env import TextEnv, register_env\n"
        "class Stuck(TextEnv):\n"
        "    def reset(self, seed=None, options=None):\n"
        "        super().reset(seed=seed)\n        return 'hi', {}\n"
        "    def step(self, action):\n        time.sleep(120)\n        return 'late', 0.0, True, False, {}\n"
        "register_env('test/StuckStep-v0', entry_point=Stuck)\n")
    env = {**os.environ, "AGENTRL_ENV_TOKEN": "t0ken",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "agentrl", "env", "serve", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        while "agentrl env server on" not in banner and proc.poll() is None:
            banner = proc.stdout.readline()
        base = re.search(r"on (http://127\.0\.0\.1:\d+)", banner).group(1)
        auth = {"Authorization": "Bearer t0ken"}
        with httpx.Client(base_url=base, timeout=30, headers=auth) as c:
            for _ in range(100):  # the banner comes before uvicorn accepts
                try:
                    made = c.post("/envs", json={"env_id": "stuck_step_envs:test/StuckStep-v0"})
                    break
                except httpx.TransportError:
                    threading_wait(0.1)
            assert made.status_code == 200, made.text
            eid = made.json()["id"]
        stepping = threading.Thread(target=lambda: httpx.post(f"{base}/envs/{eid}/step", json={"action": "go"},
                                                              headers=auth, timeout=200), daemon=True)
        stepping.start()
        threading_wait(1.0)  # the step is in the env now
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        said = proc.communicate(timeout=100)[0]
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert took < 30, f"the stop took {took:.0f} s: {said}"
