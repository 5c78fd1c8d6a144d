"""Sandbox round-trip latency per backend: cold, warm (pooled), persistent interpreter, 8-way.

For each backend available here (``local``, ``bwrap``, ``docker``, and ``remote``
serving ``bwrap`` in-process over HTTP on 127.0.0.1):

- cold:   new sandbox each time (create + start + one exec; close not counted)
- warm:   one exec on a sandbox leased from a warm ``SandboxPool``
- interp: one snippet through ``PythonInterpreter`` (state kept, fork per snippet)
- par8:   execs/s of ``true`` with 8 concurrent execs on 8 pooled sandboxes

"cmd" is ``true``; "py" is ``python3 -c pass`` (cold/warm) or ``x = 1`` (interp).
Prints a table and writes ``bench/sandbox_latency.json`` next to this script.

    .venv/bin/python bench/sandbox_latency.py [--reps 20] [--backends local,bwrap]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agentrl.errors import SandboxUnavailableError
from agentrl.sandboxes import (
    BwrapSandbox,
    DockerSandbox,
    LocalSandbox,
    PythonInterpreter,
    RemoteSandbox,
    Sandbox,
    SandboxPool,
    check_backend,
)

TARGETS_MS = {  # the project's targets on a 2-core machine: (backend, path, kind) -> p50 ms
    ("*", "interp", "py"): 3.0,
    ("bwrap", "cold", "py"): 40.0,
    ("docker", "warm", "cmd"): 120.0,
}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] * 1000


def _stats(xs: list[float]) -> dict:
    return {"p50_ms": _pct(xs, 0.5), "p99_ms": _pct(xs, 0.99), "n": len(xs)}


async def _timed(fn: Callable, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


async def _bench_backend(factory: Callable[[], Sandbox], reps: int, cold_reps: int) -> dict:
    res: dict = {}
    py = ["python3", "-c", "pass"]
    for kind, argv in (("cmd", ["true"]), ("py", py)):
        times = []
        for _ in range(cold_reps):
            box = factory()
            t = time.perf_counter()
            await box.start()
            r = await box.run(argv)
            times.append(time.perf_counter() - t)
            await box.close()
            assert r.exit_code == 0, r
        res[f"cold/{kind}"] = _stats(times)
    async with SandboxPool(factory, size=8) as pool:
        async with pool.lease() as box:
            await box.run(["true"])  # first-use effects out of the way
            res["warm/cmd"] = _stats(await _timed(lambda: box.run(["true"]), reps))
            res["warm/py"] = _stats(await _timed(lambda: box.run(py), reps))
            async with PythonInterpreter(box) as it:
                await it.execute("x = 0")
                res["interp/py"] = _stats(await _timed(lambda: it.execute("x = 1"), reps * 3))
        boxes = [await pool.acquire() for _ in range(8)]
        n = max(reps * 4, 40)
        t = time.perf_counter()

        async def worker(b: Sandbox, k: int) -> None:
            for _ in range(k):
                await b.run(["true"])

        await asyncio.gather(*(worker(b, n // 8) for b in boxes))
        res["par8/cmd"] = {"execs_per_s": (n // 8) * 8 / (time.perf_counter() - t)}
        for b in boxes:
            await pool.release(b)
    return res


def _remote_factory() -> tuple[Callable[[], Sandbox], Callable[[], None]]:
    """Serve bwrap (or local) over real HTTP on 127.0.0.1 in a background thread."""
    import threading

    import uvicorn

    from agentrl.sandboxes.server import bind_socket, create_app

    inner: type[Sandbox] = BwrapSandbox
    try:
        check_backend("bwrap")
    except SandboxUnavailableError:
        inner = LocalSandbox
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(inner, "bench"), log_level="warning"))
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return (lambda: RemoteSandbox(f"http://127.0.0.1:{port}", "bench")), stop


def _check_targets(results: dict) -> list[dict]:
    rows = []
    for (backend, path, kind), target in TARGETS_MS.items():
        for name, res in results.items():
            # "*" means every backend on this machine; remote adds an HTTP hop on purpose.
            applies = backend == name or (backend == "*" and name != "remote")
            if applies and f"{path}/{kind}" in res:
                p50 = res[f"{path}/{kind}"]["p50_ms"]
                rows.append(
                    {"backend": name, "path": f"{path}/{kind}", "p50_ms": p50,
                     "target_ms": target, "met": p50 <= target}
                )  # fmt: skip
    return rows


async def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cold-reps", type=int, default=10)
    ap.add_argument("--backends", default="local,bwrap,docker,remote")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args(argv)
    factories: dict[str, Callable[[], Sandbox]] = {
        "local": LocalSandbox, "bwrap": BwrapSandbox, "docker": DockerSandbox,
    }  # fmt: skip
    results: dict = {}
    skipped: dict[str, str] = {}
    stop = None
    for name in args.backends.split(","):
        try:
            if name == "remote":
                factory, stop = _remote_factory()
            else:
                check_backend(name)
                factory = factories[name]
        except (SandboxUnavailableError, KeyError, ImportError) as e:
            skipped[name] = str(e)
            print(f"skip {name}: {e}", file=sys.stderr)
            continue
        results[name] = await _bench_backend(factory, args.reps, args.cold_reps)
    if stop:
        stop()
    report = {
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "results": results,
        "skipped": skipped,
        "targets": _check_targets(results),
    }
    _print_table(results, report["targets"])
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


def _print_table(results: dict, targets: list[dict]) -> None:
    cols = ["cold/cmd", "cold/py", "warm/cmd", "warm/py", "interp/py"]
    print(f"{'backend':8} " + " ".join(f"{c + ' p50/p99 ms':>22}" for c in cols) + "  par8 exec/s")
    for name, res in results.items():
        cells = [f"{res[c]['p50_ms']:9.1f} / {res[c]['p99_ms']:8.1f}  " for c in cols]
        print(
            f"{name:8} "
            + " ".join(f"{c:>22}" for c in cells)
            + f"  {res['par8/cmd']['execs_per_s']:10.0f}"
        )
    for row in targets:
        verdict = "met" if row["met"] else "MISSED"
        print(f"target {row['backend']:7} {row['path']:10} p50 {row['p50_ms']:7.1f} ms "
              f"<= {row['target_ms']:.0f} ms: {verdict}")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
