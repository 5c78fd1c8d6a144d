"""pytest hooks for ``-n 2 --dist loadfile``: a worker that dies fails its one test, not the run,
and its fatal-error dump is printed at the end of the run.

pytest-xdist 3.8's loadfile scheduler puts a crashed worker's whole workload back on the queue,
the files it had finished included, as work units with nothing left to run; a worker handed one
never asks for more, and the session waits for good (pytest-xdist issues 1313 and 1378: our CI hung
at 96% for 90 minutes after one worker's segfault). It also runs the test the worker died on again,
and a replacement handed a single test waits for a second that never comes (issue 1327). The
subclass below changes those two methods and nothing else; it goes when xdist ships the fixes.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
from pathlib import Path

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # xdist is a dev extra; plain pytest needs none of this
    LoadFileScheduling = None

CRASH_DIR = "AGENTRL_TEST_CRASH_DIR"
_dump_key = pytest.StashKey()

if LoadFileScheduling is not None:

    class CrashTolerantLoadFile(LoadFileScheduling):
        def remove_node(self, node):
            workload = self.assigned_work.pop(node)
            pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
            if not pending:
                return None
            crashitem = next(nodeid for unit in pending.values() for nodeid, done in unit.items() if not done)
            for unit in pending.values():
                if crashitem in unit:
                    unit[crashitem] = True  # xdist reports it failed with the crash; not run again
            self.workqueue.update({scope: unit for scope, unit in pending.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def _reschedule(self, node):
            if node.shutting_down or node not in self.registered_collections:
                return  # a replacement still collecting is scheduled when its collection arrives
            # a worker runs a test once it holds the next one (or its shutdown): never leave it one
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()


def pytest_xdist_make_scheduler(config, log):
    if LoadFileScheduling is not None and config.getvalue("dist") == "loadfile":
        return CrashTolerantLoadFile(config, log)
    return None


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which writes to stderr
def pytest_configure(config):
    """A worker's fatal-error dump goes to a file that the controller prints at the end, where
    a log cut to its head and tail still shows it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if getattr(config.option, "numprocesses", None):
            os.environ[CRASH_DIR] = tempfile.mkdtemp(prefix="agentrl-test-crashes-")
        return
    if os.environ.get(CRASH_DIR):
        dump = open(Path(os.environ[CRASH_DIR]) / f"{worker}-{os.getpid()}.txt", "w")  # noqa: SIM115
        config.stash[_dump_key] = dump  # open until the process ends
        faulthandler.enable(file=dump, all_threads=True)


def pytest_terminal_summary(terminalreporter):
    folder = os.environ.get(CRASH_DIR)
    if os.environ.get("PYTEST_XDIST_WORKER") or not folder or not Path(folder).is_dir():
        return
    for dump in sorted(Path(folder).glob("*.txt")):
        lines = dump.read_text(errors="replace").strip().splitlines()
        if not lines:
            continue
        # the crashing thread's stack, innermost first; the other threads' stay in the file
        start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
        terminalreporter.section(f"worker {dump.stem} died (all threads: {dump})", sep="=", red=True)
        terminalreporter.write_line("\n".join([lines[0], *lines[start:start + 40]]))
