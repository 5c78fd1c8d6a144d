"""The memory a training phase frees: given back to the kernel between phases, or (opt-in) kept
in the process's heap for the next step.

Given back by default (``give_back_freed_memory``, glibc's ``malloc_trim``): glibc
raises its mmap threshold after the first large frees (up to 32 MiB), so most of
a step's buffers then come from the heap, and a heap returns only its top to the
kernel. Freed buffers below it stay resident. In ``make run`` the process held
13.1 GB during RL step 3, and one ``malloc_trim(0)`` (called through gdb) took it
to 3.4 GB: three quarters of it was memory the process had freed. The
trainer gives it back at the start of each phase (an evaluation, the SFT, an RL
step) and before each update: make run's RL steps then peaked at 8.1-8.6 GB
instead of 13.2-13.5. It costs time, as the next phase touches fresh pages: in
two runs with these trims the rollouts, the same tokens, took 1.3-1.6 s and
5.5-7.4 s a step more (27-35 s without), and whole RL steps 4% and 10-14% more;
the updates' tokens/s fell 0-5%, the SFT's did not (bench/make_run.json,
``memory_2026_12_05``).

Kept, opt-in:

glibc hands every allocation over 128 KiB (up to 32 MiB as it adapts) to the
kernel as a fresh ``mmap`` and unmaps it on free. A training step on CPU
frees and allocates hundreds of such buffers (activations, casts of the
weights, gradients; SmolLM2's tied embedding gradient alone is 113 MB), and
the kernel zeroes each new page on first touch: the embedding's backward took
277 ms into a fresh buffer and 26 ms into a reused one. With ``M_MMAP_MAX =
0`` every allocation comes from the heap, and with ``M_TRIM_THRESHOLD`` at its
largest glibc never gives freed memory back, so a step's buffers are those of
the step before. On 2 Sapphire Rapids cores (bench/heap_reuse.json) make run's
SFT update ran 1.11x faster in fp32 and 1.13x in bf16, the same bits.

Why it is off unless ``AGENTRL_KEEP_FREED_MEMORY=1``: the heap cannot give
back a hole that a small live allocation pins, so where buffer sizes change
from step to step (RL batches of varying lengths) resident memory can grow
with every step instead of staying at one peak. A synthetic loop (a small
model trained 500 steps on batches of 64-1,536 tokens) held 7-8 GB kept
against 3 GB by default, still rising; ``make run`` (the GRPO recipe, 15 min) peaked 0.8 GB
higher (15.1 against 14.3 GB), and its whole time did not change. Memory of a
one-off phase (loading, an evaluation's KV cache) also stays resident.

glibc's ``malloc_trim`` and ``mallopt`` through ctypes, because neither torch nor
the standard library calls them, and the ``MALLOC_*`` environment variables are
read only when a process starts. Neither is called where another allocator
serves ``malloc`` (jemalloc or tcmalloc through ``LD_PRELOAD``): glibc's heap
then holds nothing to give back or keep, and that allocator's own settings
(``MALLOC_CONF``, ``TCMALLOC_*``) decide instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

__all__ = ["give_back_freed_memory", "glibc_malloc_in_use", "keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_NEVER = -1  # as glibc's size_t: a trim threshold no heap reaches


@functools.cache  # find_library runs ldconfig: once a process
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def glibc_malloc_in_use() -> bool:
    """Whether this process's ``malloc`` is glibc's: not where ``LD_PRELOAD`` put another
    allocator (jemalloc, tcmalloc) in front of it, nor where the C library is not found."""
    libc = _libc()
    if libc is None:
        return False
    try:  # the malloc every library resolves to, against the C library's own
        used = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
        own = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    except (AttributeError, OSError):
        return False
    return used is not None and used == own


def _keeping() -> bool:
    flag = os.environ.get("AGENTRL_KEEP_FREED_MEMORY", "0").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"AGENTRL_KEEP_FREED_MEMORY must be 0 or 1, got {flag!r}")
    return flag == "1"


def give_back_freed_memory() -> bool:
    """Return the free pages of glibc's heaps to the kernel (``malloc_trim(0)``), between two
    phases of a run; whether it ran. It does not run under ``AGENTRL_KEEP_FREED_MEMORY=1``,
    which asks for the opposite, nor where the C library has no ``malloc_trim`` or another
    allocator serves ``malloc`` (``glibc_malloc_in_use``)."""
    if _keeping() or not glibc_malloc_in_use():
        return False
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def keep_freed_memory() -> bool:
    """Under ``AGENTRL_KEEP_FREED_MEMORY=1``, tell glibc's malloc to serve every allocation from
    the heap and never give freed memory back; the ``agentrl`` command calls it at start.

    Returns whether it took effect: False where the variable is unset or ``0``,
    where the C library has no ``mallopt`` (musl, macOS, Windows), and where another
    allocator serves ``malloc`` (``glibc_malloc_in_use``). Any other value than ``0`` or
    ``1`` is an error naming the variable.
    """
    if not _keeping() or not glibc_malloc_in_use():
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, _NEVER)) and bool(mallopt(_M_MMAP_MAX, 0))  # 1 on success
