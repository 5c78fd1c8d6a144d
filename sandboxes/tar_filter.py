"""What restoring a workdir snapshot may write: one tar extraction filter, used in two places.

``untar_into`` (``_files.py``) restores a snapshot on the host, and
``ToolEnv``'s put-back (``agentrl.tools.tool_env``) restores one inside the
sandbox with the sandbox's own Python, which cannot import agentrl: it runs
this function's source. Both must keep exactly what ``tar_dir`` stores, and
let nothing land outside the workdir.
"""

from __future__ import annotations

import os
import tarfile

__all__ = ["restore_filter"]


def restore_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "tar" filter (nothing lands outside ``dest``, even through a symlink),
    keeping only what ``tar_dir`` stores: files, dirs and symlinks, which may point
    anywhere (``py -> /usr/bin/python3``) as they would in the sandbox.

    Nor is anything written at or beneath a symlink already there (one the archive
    made: both places restore into a swept workdir). ``tar_dir`` stores each path once
    and nothing beneath a symlink, and tarfile's own check resolves paths with
    ``realpath``, which a chain of symlinks past PATH_MAX gets through on Pythons
    before 3.11.13 (CVE-2025-4517); this one ``lstat``s a component at a time.
    """
    kept = tarfile.tar_filter(member, dest)
    if not (kept.isreg() or kept.isdir() or kept.issym()):
        return None
    path = dest
    for part in os.path.normpath(kept.name).split(os.sep):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return None
    return kept
