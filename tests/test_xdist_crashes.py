"""tests/xdist_crashes.py: under -n 2 --dist loadfile a worker's segfault fails its one test, every
other test still runs, the run ends, and the crashing stack is printed at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="the scheduler under test is pytest-xdist's")

_REPO = Path(__file__).resolve().parents[1]
_CRASH = "import os, signal\n\ndef {name}():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"


def test_a_segfaulting_worker_fails_only_its_test_and_the_run_ends(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.xdist_crashes import *  # noqa: F403\n")
    # A crash mid-file (the rest of the file still runs), a file that is one crashing test (its
    # replacement must not wait for a second), and enough plain files that each worker has
    # finished some before it dies: those are what xdist 3.8 queued again and hung on.
    (tmp_path / "test_crash_mid.py").write_text(
        "def test_before():\n    pass\n\n" + _CRASH.format(name="test_dies") + "\n\ndef test_after():\n    pass\n")
    (tmp_path / "test_crash_single.py").write_text(_CRASH.format(name="test_only"))
    for i in range(8):
        (tmp_path / f"test_ok{i}.py").write_text("import time\n\ndef test_a():\n    time.sleep(0.1)\n\n"
                                                  "def test_b():\n    pass\n")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
         str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(_REPO), "HOME": str(tmp_path)})
    out = res.stdout + res.stderr
    assert "CrashTolerantLoadFile" in out, out[-3000:]
    assert res.returncode == 1, out[-3000:]
    assert "2 failed, 18 passed" in out, out[-3000:]  # test_after and all 16 plain tests ran
    assert "PASSED test_crash_mid.py::test_after" in out
    for name in ("test_crash_mid.py::test_dies", "test_crash_single.py::test_only"):
        assert f"crashed while running '{name}'" in out
        assert out.count(f"PASSED {name}") == 0
    # the end of the log names the line that crashed
    summary = out[out.index("died (all threads"):]
    assert "Fatal Python error: Segmentation fault" in summary
    assert "test_crash_mid.py\", line 7 in test_dies" in summary
    assert "test_crash_single.py\", line 4 in test_only" in summary
