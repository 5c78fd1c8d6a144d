"""``agentrl sandbox ...``: build the docker image, serve a backend over HTTP, list backends.

Mounted by the main CLI with ``app.add_typer(sandboxes.cli.app, name="sandbox")``.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from agentrl.errors import AgentRLError

__all__ = ["app"]

app = typer.Typer(help="Sandbox backends: build the image, serve over HTTP, check what runs here.")


@app.command("build-image")
def build_image_cmd(
    tag: str = typer.Option("agentrl-sandbox:bookworm", help="Image tag to create."),
    suite: str = typer.Option("bookworm", help="Debian suite for debootstrap."),
    mirror: str = typer.Option("http://deb.debian.org/debian", help="Debian mirror URL."),
    force: bool = typer.Option(False, help="Rebuild even when the tag exists."),
) -> None:
    """Build the docker sandbox image offline: debootstrap minbase + python3, docker import."""
    from .docker import build_image, docker_client

    try:
        if not force:
            client = docker_client()
            try:
                image = client.images.get(tag)
                typer.echo(f"{tag} already exists ({image.short_id}); --force rebuilds it")
                return
            except Exception:  # docker.errors.ImageNotFound: build it below
                pass
            finally:
                client.close()
        typer.echo(f"building {tag} with debootstrap ({suite}); about a minute ...")
        typer.echo(f"built {tag}: {build_image(tag=tag, suite=suite, mirror=mirror)}")
    except AgentRLError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e


@app.command("serve")
def serve_cmd(
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8765, help="TCP port."),
    token_file: Path | None = typer.Option(
        None,
        help="File holding the bearer token clients must send; else $AGENTRL_SANDBOX_TOKEN. "
        "There is no --token: a command line is readable by every user in /proc.",
        show_default=False,
    ),
    backend: str = typer.Option("bwrap", help="Backend each session runs: local, bwrap, docker."),
    max_request_mb: int = typer.Option(32, help="Largest request body accepted, MiB."),
    max_sessions: int = typer.Option(64, help="Most sessions alive at once."),
    max_concurrent: int = typer.Option(256, help="Most requests in flight; more get 503."),
) -> None:
    """Serve sandboxes of BACKEND over HTTP for RemoteSandbox clients."""
    from .registry import BACKENDS, check_backend
    from .server import serve

    token = _read_token(token_file)
    if backend == "remote":
        typer.echo("error: serving 'remote' would only proxy; pick a local backend", err=True)
        raise typer.Exit(2)
    try:
        check_backend(backend)
    except AgentRLError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    limits = {
        "max_request_bytes": max_request_mb << 20,
        "max_sessions": max_sessions,
        "max_concurrent": max_concurrent,
    }
    serve(BACKENDS[backend], host, port, token, **limits)


def _read_token(token_file: Path | None) -> str:
    """The token from ``token_file``, else $AGENTRL_SANDBOX_TOKEN; exit 2 when empty."""
    if token_file is None:
        token = os.environ.get("AGENTRL_SANDBOX_TOKEN", "").strip()
    else:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            typer.echo(f"error: cannot read --token-file {token_file}: {e.strerror}", err=True)
            raise typer.Exit(2) from e
    if not token:
        typer.echo(
            "error: a token is required: --token-file PATH or $AGENTRL_SANDBOX_TOKEN", err=True
        )
        raise typer.Exit(2)
    return token


@app.command("backends")
def backends_cmd() -> None:
    """List the backends, their isolation, and what each enforces here or why it cannot run."""
    from .registry import BACKENDS, describe_backends

    for name, what in describe_backends().items():
        typer.echo(f"{name:8} {BACKENDS[name].ISOLATION:11} {what}")
