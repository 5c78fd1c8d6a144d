"""pytest hooks for ``-n 2 --dist loadfile``: a worker that dies fails its one test, not the run,
and its fatal-error dump is printed when it goes down and again at the end of the run.

pytest-xdist 3.8's loadfile scheduler puts a crashed worker's whole workload back on the queue,
the files it had finished included, as work units with nothing left to run; a worker handed one
never asks for more, and the session waits for good (pytest-xdist issues 1313 and 1378: our CI hung
at 96% for 90 minutes after one worker's segfault). It also runs the test the worker died on again,
and a replacement handed a single test waits for a second that never comes (issue 1327). The
subclass below changes ``remove_node`` and ``_reschedule`` for those, and ``add_node_collection``
so that a replacement which collected other tests is let go rather than left waiting; it goes when
xdist ships the fixes.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

try:
    import xdist
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # xdist is a dev extra; plain pytest needs none of this
    LoadFileScheduling = None
else:  # the subclass leans on 3.8's private methods: another release gets xdist's own scheduler
    if not xdist.__version__.startswith("3.8."):
        LoadFileScheduling = None

CRASH_DIR = "AGENTRL_TEST_CRASH_DIR"
_dump_key = pytest.StashKey()
_dir_key = pytest.StashKey()

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

        def add_node_collection(self, node, collection):
            super().add_node_collection(node, collection)
            if self.collection_is_completed and node not in self.registered_collections:
                node.shutdown()  # a replacement that collected other tests gets no work: let it go

        def _reschedule(self, node):
            if node.shutting_down or node not in self.registered_collections:
                return  # a replacement still collecting is scheduled when its collection arrives
            # a worker runs a test once it holds the next one (or its shutdown): never leave it one
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if LoadFileScheduling is not None and config.getvalue("dist") == "loadfile":
        return CrashTolerantLoadFile(config, log)
    return None


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which writes to stderr
def pytest_configure(config):
    """A worker's fatal-error dump goes to a file, which the controller prints when the worker
    goes down and again at the end of the run, where a log cut to its head and tail shows it."""
    if not hasattr(config, "workerinput"):  # the controller, or pytest without -n
        if getattr(config.option, "numprocesses", None):
            config.stash[_dir_key] = os.environ[CRASH_DIR] = tempfile.mkdtemp(prefix="agentrl-test-crashes-")
        return
    folder = os.environ.pop(CRASH_DIR, None)  # a pytest this worker starts keeps its own stderr
    if folder:
        dump = open(Path(folder) / f"{config.workerinput['workerid']}-{os.getpid()}.txt", "w")  # noqa: SIM115
        config.stash[_dump_key] = dump  # open until the process ends
        faulthandler.enable(file=dump, all_threads=True)


def _dumps(config, worker: str = "*") -> list[tuple[Path, list[str]]]:
    folder = config.stash.get(_dir_key, None)
    if folder is None or not Path(folder).is_dir():
        return []
    found = []
    for dump in sorted(Path(folder).glob(f"{worker}-*.txt")):
        lines = dump.read_text(errors="replace").strip().splitlines()
        if lines:
            found.append((dump, lines))
    return found


def _crashing_stack(lines: list[str]) -> str:
    # the crashing thread's stack, innermost first; the other threads' stay in the file
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
    return "\n".join([lines[0], *lines[start:start + 40]])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if error is None:
        return
    for dump, lines in _dumps(node.config, node.gateway.id):
        node.config.get_terminal_writer().line(f"\n[{node.gateway.id}] {dump}:\n{_crashing_stack(lines)}")


def pytest_terminal_summary(terminalreporter, config):
    for dump, lines in _dumps(config):
        terminalreporter.section(f"worker {dump.stem} died (all threads: {dump})", sep="=", red=True)
        terminalreporter.write_line(_crashing_stack(lines))


def pytest_unconfigure(config):
    folder = config.stash.get(_dir_key, None)
    if folder is not None and not _dumps(config):
        shutil.rmtree(folder, ignore_errors=True)  # nothing died: nothing to keep
