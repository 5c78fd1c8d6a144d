"""CLI smoke tests: the proxy and env commands are mounted; env serve refuses to run without a token."""

from __future__ import annotations

from typer.testing import CliRunner

from agentrl.cli import _mount_plugins, app


def test_proxy_and_env_commands_are_mounted_and_env_needs_a_token(monkeypatch):
    _mount_plugins()
    runner = CliRunner()
    out = runner.invoke(app, ["proxy", "serve", "--help"])
    assert out.exit_code == 0 and "--token-file" in out.output
    monkeypatch.delenv("AGENTRL_ENV_TOKEN", raising=False)
    out = runner.invoke(app, ["env", "serve"])
    assert out.exit_code == 2 and "token is required" in out.output
