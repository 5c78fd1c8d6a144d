"""agentrl.heap: freed memory goes back to the kernel between phases, stays in the process's heap
only when asked for, and the switch's errors."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from agentrl.heap import keep_freed_memory

# 256 MB allocated, written (so its pages are resident), freed: what is resident after?
_PROBE = textwrap.dedent("""
    import os, sys
    from agentrl.heap import keep_freed_memory
    kept = keep_freed_memory()
    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    before = rss_mb()
    buf = b"x" * (256 << 20)
    held = rss_mb()
    del buf
    print(kept, held - before, rss_mb() - before)
""")


def _probe(flag: str | None, script: str = _PROBE, preload: str | None = None) -> tuple[bool, float, float]:
    """Run ``script`` under glibc's malloc (or ``preload``'s) and ``AGENTRL_KEEP_FREED_MEMORY=flag``."""
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTRL_KEEP_FREED_MEMORY", "LD_PRELOAD")}
    if flag is not None:
        env["AGENTRL_KEEP_FREED_MEMORY"] = flag
    if preload is not None:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", float(out[1]), float(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt and Linux's /proc")
def test_freed_memory_stays_resident_only_when_asked_for():
    kept, held, after = _probe("1")
    assert kept and held > 200 and after > 200, (held, after)  # the freed 256 MB is still the process's
    for flag in (None, "0"):  # the default: glibc's, unmapped on free
        kept, held, after = _probe(flag)
        assert not kept and held > 200 and after < 50, (flag, held, after)


def test_a_bad_switch_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("AGENTRL_KEEP_FREED_MEMORY", "yes")
    with pytest.raises(ValueError, match="AGENTRL_KEEP_FREED_MEMORY must be 0 or 1, got 'yes'"):
        keep_freed_memory()
    res = subprocess.run([sys.executable, "-m", "agentrl", "envs", "list"], capture_output=True, text=True,
                         env={"AGENTRL_KEEP_FREED_MEMORY": "yes", "PATH": "/usr/bin:/bin"})
    assert res.returncode != 0 and "AGENTRL_KEEP_FREED_MEMORY must be 0 or 1" in res.stderr


# What glibc keeps without being asked: once a 16 MB buffer is freed its mmap threshold rises to
# 16 MiB, so 1 MB buffers then come from the heap; a small live object after each pins the heap's
# top, so freeing the buffers returns nothing. How much is resident before and after the call?
_TRIM_PROBE = textwrap.dedent("""
    import os
    from agentrl.heap import give_back_freed_memory
    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    del_big = bytearray(16 << 20)
    del del_big
    base = rss_mb()
    bufs, pins = [], []
    for _ in range(256):
        bufs.append(b"x" * (1 << 20))
        pins.append(bytearray(1024))  # over pymalloc's 512 bytes: from the heap too
    bufs.clear()
    freed = rss_mb() - base
    ran = give_back_freed_memory()
    print(ran, freed, rss_mb() - base)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc_trim and Linux's /proc")
def test_memory_a_phase_freed_goes_back_to_the_kernel_unless_kept():
    for flag in (None, "0"):
        ran, freed, after = _probe(flag, _TRIM_PROBE)
        assert ran and freed > 200 and after < 50, (flag, freed, after)  # 256 MB freed but resident, then given back
    ran, freed, after = _probe("1", _TRIM_PROBE)
    assert not ran and after > 200, (freed, after)  # kept, as asked


JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2 (.ci/sandbox-setup.sh)


@pytest.mark.skipif(not os.path.exists(JEMALLOC), reason=f"no {JEMALLOC}: apt-get install libjemalloc2")
def test_under_another_allocator_neither_switch_calls_glibc_and_both_say_so():
    """With jemalloc preloaded, glibc's heap holds nothing: the trim and the keep report that they
    did not run, and the freed buffer's fate is jemalloc's (it runs, frees, and reports cleanly)."""
    check = "from agentrl.heap import glibc_malloc_in_use; print(glibc_malloc_in_use())"
    for preload, used in ((None, "True"), (JEMALLOC, "False")):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | ({"LD_PRELOAD": preload} if preload else {})
        assert subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                              check=True).stdout.strip() == used
    ran, _, _ = _probe(None, _TRIM_PROBE, preload=JEMALLOC)
    assert not ran
    kept, held, _ = _probe("1", preload=JEMALLOC)
    assert not kept and held > 200  # the 256 MB buffer was made; the keep switch did not claim it
