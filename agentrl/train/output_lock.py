"""One training run at a time in an output folder.

``make run`` passes ``--overwrite``. Started again while an earlier run still trained
(a second terminal, a job left in the background), it deleted that run's checkpoints,
TensorBoard events and saved trees under it, and both then wrote into one folder.
``--resume`` beside a live run did the same to the newest checkpoint.

``output_lock`` holds an advisory ``fcntl.flock`` on ``<dir>/.run.lock`` while
``agentrl.train.train`` runs (``agentrl train`` and ``agentrl sft``; a ``Trainer``
driven by hand takes no lock). The kernel drops the lock when the process ends,
however it ends; a child forked without exec closes its copy (``os.register_at_fork``),
so it cannot keep the folder locked after the run. The file keeps the holder's pid,
host and start time only to say who holds it. Where locks do not work (no ``fcntl``
on Windows; ``flock`` unsupported on Lustre without ``-o flock`` or NFS without lockd)
the run goes on unlocked, with a warning. Over NFS a lock may be host-local.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "output_lock"]

LOCK_FILE = ".run.lock"
_HELD: set[int] = set()  # this process's lock descriptors, closed in forked children


def _close_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _check_writable(out: Path, key: str) -> None:
    """Make and remove a file in ``out``, or raise ``ConfigError`` naming ``key``: in a folder this
    user cannot write into (another user's run, whose lock file still opens read-only for
    ``flock``) the run went on, and failed only when it wrote its results, after its episodes."""
    try:
        fd, name = tempfile.mkstemp(dir=out, prefix=".write-check-")
    except OSError as e:  # no permission, a read-only filesystem, a full disk
        raise ConfigError(f"{key}={out}: cannot write into the folder: {e.strerror or e}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


@contextlib.contextmanager
def output_lock(out: Path, key: str = "train.output.dir") -> Iterator[None]:
    """Hold ``out``'s run lock inside; ``ConfigError`` naming ``key`` if another run holds it,
    or the folder is a file, cannot be made or cannot be written into."""
    try:
        made = not out.exists()
    except OSError as e:  # a folder on the path this user cannot enter
        raise ConfigError(f"{key}={out}: cannot look the folder up: {e.strerror or e}") from None
    if not made and not out.is_dir():
        raise ConfigError(f"{key}={out} is a file, not a folder: give the run a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a dangling symlink, a file on the path, no permission
        raise ConfigError(f"{key}={out}: cannot make the folder: {e.strerror or e}") from None
    try:
        _check_writable(out, key)
        yield from _locked(out, key, made)
    finally:
        if made:  # a run that failed before writing anything leaves no folder behind
            with contextlib.suppress(OSError):
                out.rmdir()


def _open(path: Path, out: Path, key: str) -> int:
    try:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's lock file: flock needs only a read descriptor
            return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"{key}={out}: cannot open its {LOCK_FILE}: {e.strerror or e}") from None


def _still_there(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` locked: a run that made the folder and failed
    unlinks its lock file while it holds it, and a lock on that unlinked file guards nothing."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _locked(out: Path, key: str, made: bool) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    path = out / LOCK_FILE
    fd = _open(path, out, key)
    try:
        locked = True
        for _ in range(100):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
                raise ConfigError(f"{key}={out} is in use by another run ({holder}): wait for it to end, "
                                  f"or give this run another {key}") from None
            except OSError as e:  # ENOSYS, ENOLCK, EOPNOTSUPP, EINVAL: this filesystem does not lock
                locked = False
                warnings.warn(f"{key}={out}: this filesystem does not lock files "
                              f"({errno.errorcode.get(e.errno, e.errno)}): nothing stops a second run from "
                              "writing into this folder", RuntimeWarning, stacklevel=4)
                break
            if _still_there(fd, path):
                break
            os.close(fd)  # locked a file its holder unlinked on the way out: lock the one there now
            with contextlib.suppress(OSError):  # it may have removed the folder it made, too
                out.mkdir(parents=True, exist_ok=True)  # (where it cannot be made, opening says why)
            fd = _open(path, out, key)
        else:
            raise ConfigError(f"{key}={out}: its {LOCK_FILE} kept being replaced while this run locked it")
        if locked:
            with contextlib.suppress(OSError):  # who holds it, for the next run's message only
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
            _HELD.add(fd)
        try:
            yield
        finally:
            _HELD.discard(fd)
            if made and [p.name for p in out.iterdir()] == [LOCK_FILE]:
                with contextlib.suppress(OSError):
                    path.unlink()  # while held: a run that opens it after makes its own
    finally:
        os.close(fd)  # closing the only descriptor releases the lock
