"""Safe file access under a sandbox workdir from the (privileged) host side.

The sandbox owns its workdir and may plant symlinks there (``x -> /etc/passwd``).
We walk the path one component at a time with ``O_NOFOLLOW`` relative to the
directory fd, so no symlink or ``..`` can lead a root-owned write outside.
Every open is ``O_NONBLOCK`` and only regular files are read or written: a FIFO
or device planted by the sandbox is refused, and never blocks a host thread.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile

from agentrl.errors import SandboxError

from .tar_filter import restore_filter

__all__ = [
    "checked_max_bytes",
    "read_beneath",
    "read_limit",
    "relative_parts",
    "tar_dir",
    "too_large",
    "untar_into",
    "write_beneath",
]


def relative_parts(path: str, workdir_alias: str | None = None) -> list[str]:
    """Split ``path`` into components under the workdir; refuse escapes.

    Absolute paths are allowed only when they start with ``workdir_alias`` (the
    workdir's path as the sandbox sees it, e.g. ``/work``).
    """
    if "\0" in path:
        raise SandboxError(f"path {path!r} holds a NUL byte, which no file name can")
    if os.path.isabs(path):
        alias = (workdir_alias or "").rstrip("/")
        if not alias or not (path == alias or path.startswith(alias + "/")):
            raise SandboxError(f"path {path!r} is outside the sandbox workdir; use a relative path")
        path = path[len(alias) :]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise SandboxError(f"path {path!r} must name a file inside the workdir, without '..'")
    return parts


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK


def _open_dir(root: str, parts: list[str], create: bool, owner: tuple[int, int] | None) -> int:
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_beneath(
    root: str,
    path: str,
    data: bytes,
    owner: tuple[int, int] | None = None,
    workdir_alias: str | None = None,
) -> None:
    """Write ``data`` to ``root/path`` (parents created), never following a symlink.

    Truncates only once the open file is known to be regular (a FIFO with no
    reader fails the open with ENXIO; one with a reader is refused by fstat), and
    has no other hard link: sandboxed code could link a host file into a workdir on
    the host's filesystem (where ``fs.protected_hardlinks`` is off, any file), which
    this host-side write would then fill and hand to the sandbox's user.
    """
    parts = relative_parts(path, workdir_alias)
    try:
        dfd = _open_dir(root, parts[:-1], create=True, owner=owner)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "wb") as f:
            _require_regular(f.fileno(), path)
            if os.fstat(f.fileno()).st_nlink > 1:
                raise SandboxError(f"{path!r} has another hard link; write to a new path instead")
            os.ftruncate(f.fileno(), 0)
            f.write(data)
            if owner is not None:
                os.fchown(f.fileno(), *owner)
    except OSError as e:
        raise SandboxError(f"cannot write {path!r} in the sandbox: {e.strerror or e}") from e


def checked_max_bytes(max_bytes: int | None) -> int | None:
    """``read_file``'s ``max_bytes``: None or an int >= 0, else a ``SandboxError`` naming it."""
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
    ):
        raise SandboxError(f"read_file: max_bytes must be an int >= 0 or None, not {max_bytes!r}")
    return max_bytes


def read_limit(fsize_mb: int, max_bytes: int | None) -> int:
    """The most bytes one ``read_file`` returns: ``max_bytes``, capped at ``fsize_mb`` MiB."""
    cap = fsize_mb << 20
    max_bytes = checked_max_bytes(max_bytes)
    return cap if max_bytes is None else min(cap, max_bytes)


def too_large(path: str, limit: int) -> SandboxError:
    """The error of a read refused for size; it names the limit and what to do instead."""
    return SandboxError(
        f"{path!r} is larger than {limit} bytes; read parts of it with a command "
        "(head -c, tail -c, sed -n)"
    )


def read_beneath(root: str, path: str, limit: int, workdir_alias: str | None = None) -> bytes:
    """Read up to ``limit`` bytes of ``root/path``, never following a symlink.

    A file whose size is over ``limit`` is refused before any read; otherwise memory
    grows with what the file holds, never past ``limit`` + 1 bytes (it may grow meanwhile).
    """
    parts = relative_parts(path, workdir_alias)
    try:
        dfd = _open_dir(root, parts[:-1], create=False, owner=None)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            _require_regular(f.fileno(), path)
            size = os.fstat(f.fileno()).st_size
            if size > limit:  # a sparse file too: never read what we would refuse
                raise too_large(path, limit)
            data = _read_at_most(f, limit, size)
    except OSError as e:
        raise SandboxError(f"cannot read {path!r} in the sandbox: {e.strerror or e}") from e
    if len(data) > limit:
        raise too_large(path, limit)
    return data


def _read_at_most(f: io.BufferedReader, limit: int, size: int) -> bytes:
    """At most ``limit`` + 1 bytes of ``f``, ``size`` bytes long at its fstat. One read of
    that size (``read(n)`` allocates n bytes up front, whatever the file holds); chunks
    after it only when the file grew since."""
    data = f.read(size + 1)
    if len(data) <= size:  # end of file where fstat said: the usual case
        return data
    parts, total = [data], len(data)
    while total <= limit and (chunk := f.read(min(1 << 20, limit + 1 - total))):
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def _require_regular(fd: int, path: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise SandboxError(f"{path!r} is not a regular file (a FIFO, device or socket); refused")


def tar_dir(root: str, limit: int) -> bytes:
    """The contents of ``root`` as an uncompressed tar: regular files, dirs and symlinks
    (stored, not followed). FIFOs, sockets and devices are left out.

    Walked by dir fd like ``write_beneath``: a path the sandbox swaps for a symlink
    or a FIFO while we walk can neither lead outside nor block the host. An archive
    over ``limit`` bytes is refused before it is built: a sparse file takes no room in
    the workdir but is stored at its full size, on the host's heap.
    """
    buf = io.BytesIO()
    try:
        fd = os.open(root, _DIR_FLAGS)
        try:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                _tar_tree(tar, fd, "", limit)
        finally:
            os.close(fd)
    except OSError as e:  # tarfile's own errors (a file shrank mid-read) are OSErrors too
        raise SandboxError(f"cannot snapshot the sandbox workdir: {e}") from e
    return buf.getvalue()


def _tar_info(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, stat.S_IMODE(st.st_mode), int(st.st_mtime)
    return info


def _tar_tree(tar: tarfile.TarFile, dfd: int, prefix: str, limit: int) -> None:
    for name in sorted(os.listdir(dfd)):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        _check_room(tar, 0, limit)
        if stat.S_ISLNK(st.st_mode):
            info = _tar_info(prefix + name, st, tarfile.SYMTYPE)
            info.linkname = os.readlink(name, dir_fd=dfd)
            tar.addfile(info)
        elif stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                tar.addfile(_tar_info(prefix + name, os.fstat(sub), tarfile.DIRTYPE))
                _tar_tree(tar, sub, f"{prefix}{name}/", limit)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):  # else swapped since the listing: left out
                    _check_room(tar, st.st_size, limit)
                    info = _tar_info(prefix + name, st, tarfile.REGTYPE)
                    info.size = st.st_size
                    tar.addfile(info, f)


def _check_room(tar: tarfile.TarFile, size: int, limit: int) -> None:
    """Refuse a member of ``size`` data bytes that would take the archive over ``limit``."""
    if tar.offset + 1024 + size > limit:  # its header (two for a long name), then its data
        raise SandboxError(
            f"cannot snapshot the sandbox workdir: the archive would be over {limit >> 20} MiB "
            "(files count at their full size, sparse ones too); remove files or raise "
            "limits.workdir_mb"
        )


def untar_into(root: str, data: bytes, owner: tuple[int, int] | None) -> None:
    """Extract a ``tar_dir`` archive into ``root``; refuses escapes, leaves out hard links."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(root, filter=restore_filter)
    except (OSError, tarfile.TarError) as e:
        raise SandboxError(f"cannot restore the snapshot: {e}") from e
    if owner is not None:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in (*dirnames, *filenames):
                os.chown(os.path.join(dirpath, name), *owner, follow_symlinks=False)
