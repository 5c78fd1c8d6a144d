"""``agentrl proxy serve`` and ``agentrl env serve``.

Mounted by the main CLI with ``mount(app)``. Tokens come from a file or an
environment variable, never from the command line (``/proc`` shows argv to
every user).

    agentrl proxy serve --backend hf --model smollm2-135m --port 8000 --out runs/proxy/trees.jsonl
    agentrl env serve --port 8766 --token-file token.txt
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from agentrl.errors import AgentRLError

__all__ = ["env_app", "mount", "proxy_app"]

proxy_app = typer.Typer(help="The OpenAI-compatible proxy that records session trees.",
                        no_args_is_help=True)
env_app = typer.Typer(help="Registered envs over HTTP, for harnesses.", no_args_is_help=True)


def mount(app: typer.Typer) -> None:
    """Add ``proxy`` and ``env`` to the main CLI."""
    app.add_typer(proxy_app, name="proxy")
    app.add_typer(env_app, name="env")


def _token(token_file: Path | None, var: str, required: bool) -> str | None:
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            typer.echo(f"error: cannot read --token-file {token_file}: {e.strerror}", err=True)
            raise typer.Exit(2) from e
    else:
        token = os.environ.get(var, "").strip()
    if required and not token:
        typer.echo(f"error: a token is required: --token-file PATH or ${var}", err=True)
        raise typer.Exit(2)
    return token or None


@proxy_app.command("serve")
def proxy_serve(
    config: Annotated[Path | None, typer.Option(
        help="YAML config; its policy and distributed sections are used.")] = None,
    backend: Annotated[str | None, typer.Option(help="Policy backend (policy.backend).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name or folder (policy.model).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="key.path=value override.")] = None,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8000,
    token_file: Annotated[Path | None, typer.Option(
        help="File with the admin token; else $AGENTRL_PROXY_TOKEN; none: no token needed.")] = None,
    served_model_name: Annotated[str, typer.Option(help="Name in /v1/models.")] = "agentrl",
    max_context_tokens: Annotated[int | None, typer.Option(
        min=16, help="Prompt plus max_tokens budget; default: the config's rollout.max_context_tokens "
        "where --config or --set gives one, else 4096.")] = None,
    out: Annotated[str | None, typer.Option(help="JSONL file closed sessions' trees are appended to.")] = None,
    auto_create_sessions: Annotated[bool, typer.Option(help="Unknown /sessions/{id} creates it.")] = False,
) -> None:
    """Serve a policy over the OpenAI API and record each session as a RolloutTree."""
    from agentrl.config import load_config
    from agentrl.httputil import listen_socket
    from agentrl.policy.for_run import open_policy, settle_for_command

    from .app import serve
    from .schemas import ProxyConfig

    token = _token(token_file, "AGENTRL_PROXY_TOKEN", required=False)
    if host not in ("127.0.0.1", "localhost", "::1") and token is None:
        typer.echo(f"warning: serving on {host} without a token: anyone who reaches it may sample",
                   err=True)
    flags = {"policy.backend": backend, "policy.model": model}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(set_ or [])
    try:
        cfg = load_config(config, overrides, ignore=("train", "sft"))  # a train config serves too
        if max_context_tokens is None and "max_context_tokens" in cfg.rollout.model_fields_set:
            max_context_tokens = cfg.rollout.max_context_tokens  # the budget the run trains within
        proxy_cfg = ProxyConfig(served_model_name=served_model_name, token=token, out=out,
                                auto_create_sessions=auto_create_sessions,
                                **({} if max_context_tokens is None else {"max_context_tokens": max_context_tokens}))
        print(settle_for_command(cfg).replace("[bold]", "").replace("[/]", ""), flush=True)
        if out is not None:  # a path it cannot append to fails now, not at the first closed session
            _check_appendable(Path(out))
        sock = listen_socket(host, port, listen=False)  # a port in use fails now; clients refused until it serves
        with sock, open_policy(cfg) as policy:  # rollout workers when the distributed section asks for them
            serve(policy, proxy_cfg, host, port, sock=sock)
    except AgentRLError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _check_appendable(path: Path) -> None:
    from agentrl.errors import ConfigError

    if path.exists() and not (path.is_file() or path.is_char_device()):  # a directory; a FIFO, whose
        raise ConfigError(f"--out {path}: cannot append to it: not a regular file")  # opening waits for a reader
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot append to it: {e.strerror or e}") from None


@env_app.command("serve")
def env_serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8766,
    token_file: Annotated[Path | None, typer.Option(
        help="File with the bearer token; else $AGENTRL_ENV_TOKEN (required).")] = None,
    max_envs: Annotated[int, typer.Option(min=1, help="Envs alive at once.")] = 256,
    imports: Annotated[list[str] | None, typer.Option(
        "--import", help="A module to import first, whose envs it registers (as env.imports in a config); "
        "repeat for more.")] = None,
) -> None:
    """Serve every registered env over HTTP (POST /envs, /envs/{id}/step, /envs/{id}/close)."""
    from agentrl.env import import_env_modules

    from .envserver import EnvServerConfig, serve_envs

    token = _token(token_file, "AGENTRL_ENV_TOKEN", required=True)
    try:
        import_env_modules(imports or [])  # before it serves: a module that cannot load fails here
        serve_envs(EnvServerConfig(token=token or "", max_envs=max_envs), host, port)
    except AgentRLError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
