"""``agentrl view`` and ``agentrl report``.

    agentrl view runs/train                      serve the run on http://127.0.0.1:8765/
    agentrl view runs/x/trajectories.jsonl --static view.html   one self-contained file
    agentrl report runs/train                    runs/train/report/report.md and its plots
    agentrl report runs/a runs/b                 two runs side by side

``register(app)`` adds both commands to the main CLI. Heavy imports
(transformers for the tokenizer, matplotlib) happen inside the commands.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from .run import Run

__all__ = ["register", "report", "run_started", "view"]


def view(
    run: Annotated[Path, typer.Argument(help="A run folder, or a trees JSONL file.")],
    static: Annotated[Path | None, typer.Option(
        "--static", help="Write one self-contained HTML file here instead of serving.")] = None,
    host: Annotated[str, typer.Option(help="Address to serve on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to serve on (0: any free one).")] = 8765,
    tokenizer: Annotated[str | None, typer.Option(
        help="Tokenizer (model name or folder) for token texts; default: the run's policy.model.")] = None,
    tokens: Annotated[bool, typer.Option(help="Decode token ids to text (loads a tokenizer).")] = True,
    limit: Annotated[int | None, typer.Option(min=0, help="--static: embed only the first N trees.")] = None,
) -> None:
    """Look at a run in a browser: its tasks, rollout trees, tokens, curves, and two steps side by side."""
    from .page import write_static
    from .run import Run
    from .tokens import load_decoder

    t0 = time.perf_counter()
    try:
        r = Run(run)
    except (FileNotFoundError, NotADirectoryError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    waiting = not len(r) and not r.metrics
    if waiting and (static is not None or not run_started(r.path)):
        typer.echo(f"error: {run} holds no trees and no metrics.jsonl (looked for trajectories.jsonl, "
                   "trees*.jsonl, trees/*.jsonl)" + ("" if static is not None else
                   f"; a run folder that holds one of {', '.join(_RUN_MARKS)} is served until its "
                   "first step comes"), err=True)
        raise typer.Exit(2)
    if waiting:
        typer.echo(f"{run}: no step yet; the page waits for the first one and fills in as the run writes")
    else:
        typer.echo(f"{run}: {len(r)} trees in {len(r.files)} file(s), {len(r.metrics)} metrics rows "
                   f"(indexed in {time.perf_counter() - t0:.1f} s)")
    if r.skipped:  # the page says so too; a tree left out must not pass unnoticed
        typer.echo(f"warning: {r.skipped_note}", err=True)

    def decoder() -> tuple[object, str]:
        if not tokens:
            return None, "token ids only (--no-tokens)"
        # a run not started yet names its model later (its config, its first checkpoint)
        config = _config_once_named(r) if waiting and tokenizer is None else r.config
        return load_decoder(config, tokenizer)

    if static is not None:
        if static.resolve() in {f.resolve() for f in r.sources()}:  # os.replace would put the page in its place
            typer.echo(f"error: --static {static} is a file of the run: write the page to another path", err=True)
            raise typer.Exit(2)
        decode, note = decoder()
        failed: list[str] = []
        try:
            path = write_static(r, static, decode, note, limit, failed)  # type: ignore[arg-type]
        except OSError as e:  # a folder there, a file on the path, no permission
            typer.echo(f"error: cannot write {static}: {e.strerror or e}", err=True)
            raise typer.Exit(2) from None
        if failed:  # the page says so when the tree is opened; say it here too
            more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
            typer.echo(f"warning: {len(failed)} tree{'s' if len(failed) > 1 else ''} could not be drawn: "
                       + "; ".join(failed[:5]) + more, err=True)
        typer.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MB); open it in a browser")
        return
    from .server import ViewerServer

    try:
        server = ViewerServer(r, host, port, decoder)  # type: ignore[arg-type]
    except OSError as e:
        typer.echo(f"error: cannot serve on {host}:{port}: {e.strerror or e} (try --port 0)", err=True)
        raise typer.Exit(2) from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: serving on {host}: anyone who can reach it can read this run", err=True)
    typer.echo(f"serving at {server.url}  (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


_RUN_MARKS = (".run.lock", "config.json", "config.yaml", "checkpoints", "trees", "summary.json")
_WAIT_POLL_S = 2.0  # how often a run not started yet is looked at again for its model


def run_started(path: Path) -> bool:
    """Whether ``path`` is a folder that a run has begun to write into: it holds the run
    lock that ``agentrl train`` takes first (``train.output_lock``), a config, checkpoints
    or a trees folder. An empty or unrelated folder (a mistyped path) is not one."""
    return path.is_dir() and any((path / mark).exists() for mark in _RUN_MARKS)


def _config_once_named(run: Run) -> dict[str, Any]:
    """The config of ``run`` as it is on disk once it names the policy's model or the run
    has trees (from then on the viewer is as if started then); looked at every 2 s."""
    while not ((run.config.get("policy") or {}).get("model") or len(run)):
        time.sleep(_WAIT_POLL_S)
        if run.changed():
            run = run.reopen()
    return run.config


def report(
    runs: Annotated[list[Path], typer.Argument(help="One run folder, or two to set side by side.")],
    out: Annotated[Path | None, typer.Option(
        help="Folder for report.md and its plots; default RUN/report (RUN_A/report-vs-B for two).")] = None,
) -> None:
    """Write report.md with PNG plots: learning curves, success per family, episode lengths,
    the branch budget and the teacher-student divergence per turn."""
    from .report import write_report

    if len(runs) > 2:
        typer.echo(f"error: give one run or two, not {len(runs)}", err=True)
        raise typer.Exit(2)
    try:
        path = write_report(list(runs), out)
    except OSError as e:  # no run there, or a report folder that cannot be made
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    """Add ``view`` and ``report`` to the main CLI."""
    app.command("view")(view)
    app.command("report")(report)
