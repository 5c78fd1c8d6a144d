"""Keep the memory a training process frees in its own heap, so the next step reuses it.

glibc hands every allocation over 128 KiB to the kernel as a fresh ``mmap`` and
unmaps it on free. A training step on CPU frees and allocates hundreds of such
buffers (activations, casts of the weights, gradients; SmolLM2's tied
embedding gradient alone is 113 MB), and the kernel zeroes each new page on
first touch: the embedding's backward took 277 ms the first time and 26 ms
into a reused buffer. With ``M_MMAP_MAX = 0`` every allocation comes from the
heap, and with a very large ``M_TRIM_THRESHOLD`` glibc keeps what is freed
there instead of returning it, so a step's buffers are those of the step
before. Measured on 2 Sapphire Rapids cores (bench/train_throughput_malloc.json):
make run's SFT update at 345 against 413 tokens/s in bf16, 242 against 264 in
fp32; peak RSS the same (6.2-6.3 GB).

The price: the process does not give memory back until it exits, so its RSS
stays at its peak. ``AGENTRL_KEEP_FREED_MEMORY=0`` turns this off.

glibc's ``mallopt`` through ctypes, because neither torch nor the standard
library sets it, and the ``MALLOC_*`` environment variables are read only when
a process starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_KEEP = 2**31 - 1  # the largest trim threshold mallopt takes (an int): 2 GiB free at the heap's top


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve every allocation from the heap and keep what is freed there.

    Returns whether it took effect: False under ``AGENTRL_KEEP_FREED_MEMORY=0``
    and where the C library has no ``mallopt`` (musl, macOS, Windows). Any other
    value of the variable than ``0`` or ``1`` is an error naming it.
    """
    flag = os.environ.get("AGENTRL_KEEP_FREED_MEMORY", "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"AGENTRL_KEEP_FREED_MEMORY must be 0 or 1, got {flag!r}")
    if flag == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEEP)) and bool(mallopt(_M_MMAP_MAX, 0))  # 1 on success
