"""What restoring a workdir snapshot may write: one tar extraction filter, used in two places.

``untar_into`` (``_files.py``) restores a snapshot on the host, and
``ToolEnv``'s put-back (``agentrl.tools.tool_env``) restores one inside the
sandbox with the sandbox's own Python, which cannot import agentrl: it runs
this function's source. Both must keep exactly what ``tar_dir`` stores, and
let nothing land outside the workdir.
"""

from __future__ import annotations

import tarfile

__all__ = ["restore_filter"]


def restore_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "tar" filter (nothing lands outside ``dest``, even through a symlink),
    keeping only what ``tar_dir`` stores: files, dirs and symlinks, which may point
    anywhere (``py -> /usr/bin/python3``) as they would in the sandbox."""
    kept = tarfile.tar_filter(member, dest)
    return kept if kept.isreg() or kept.isdir() or kept.issym() else None
