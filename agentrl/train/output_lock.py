"""One training run at a time in an output folder.

``make run`` passes ``--overwrite``. Started again while an earlier run still trained
(a second terminal, a job left in the background), it deleted that run's checkpoints,
TensorBoard events and saved trees under it, and both then wrote into one folder.
``--resume`` beside a live run did the same to the newest checkpoint.

``output_lock`` holds an advisory ``fcntl.flock`` on ``<dir>/.run.lock`` for the run's
life. The kernel drops it when the process ends, however it ends, so a killed run
leaves nothing stale behind; the file keeps the holder's pid, host and start time only
to say who holds it. Where ``fcntl`` is missing (Windows) runs are not locked.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "output_lock"]

LOCK_FILE = ".run.lock"


@contextlib.contextmanager
def output_lock(out: Path, key: str = "train.output.dir") -> Iterator[None]:
    """Hold ``out``'s run lock inside; ``ConfigError`` naming ``key`` if another run holds it."""
    if fcntl is None:
        yield
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}={out} is a file, not a folder: give the run a folder")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
            raise ConfigError(f"{key}={out} is in use by another run ({holder}): wait for it to end, "
                              f"or give this run another {key}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock
