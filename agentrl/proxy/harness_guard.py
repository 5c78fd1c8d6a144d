"""A harness's guard: on Linux, the harness and every process it started die with the trainer.

``run_harness_episode`` starts ``python -I -S harness_guard.py TRAINER_PID [--remove-cwd] -- CMD...``
in place of ``CMD``. The guard asks the kernel for a SIGTERM when the trainer's thread that
started it dies (``prctl(PR_SET_PDEATHSIG)``), and to be the subreaper of what ``CMD`` starts
(``PR_SET_CHILD_SUBREAPER``: an orphaned descendant becomes its child, not init's). It runs
``CMD`` as its child, in the guard's own process group (made where its caller did not). Once
``CMD`` exits, it kills every descendant left (``kill_descendants``: one that left the group
and dropped ``AGENTRL_SESSION_ID`` too, as ``env -i setsid CMD &`` does) and exits as ``CMD``
did (its code, or the signal that ended it).

A trainer that ends normally, or times an episode out, cleans up itself (``harness._run``). A
SIGKILLed one (the OOM killer, a scheduler) cannot: then the guard does what it would have done.
It kills its descendants, every process of this user that carries the episode's
``AGENTRL_SESSION_ID`` (those that left the group, with ``setsid`` or Node's ``detached``, and
were not yet orphaned to it), then its process group, itself included;
with ``--remove-cwd``, it first removes its working directory (the episode's own). The death
signal on the harness alone would not do: the kernel clears it in every child the harness forks
(a CLI's own workers, the commands the model runs).

A SIGTERM while the trainer lives (a harness's ``kill 0``) is ignored. Where ``CMD`` cannot be
run, the guard writes ``START_FAILED`` and the reason to standard error and exits with 127.

It runs as a script, not as ``agentrl.proxy.harness_guard``: one starts per episode, and the
package's imports would cost seconds. ``harness.py`` imports ``marked`` and ``kill_marked`` from
here, so both kill the same processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

__all__ = ["START_FAILED", "descendants", "kill_descendants", "kill_marked", "marked"]

START_FAILED = "agentrl harness guard: the harness command could not start: "
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36


def descendants(root: int) -> list[int]:
    """The live (not zombie) processes below ``root``, by the parent each names in
    ``/proc/<pid>/stat``; none where there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]  # the name may hold ")"
            except (OSError, ValueError):  # gone
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(root: int | None = None, passes: int = 20) -> None:
    """Kill every process below ``root`` (None: this one, which reaps those orphaned to it); a
    pass more for each generation that was forking meanwhile (their orphans come up to the
    guard, the subreaper). ``root`` must be alive, or its pid may be another process's."""
    me = os.getpid()
    root = me if root is None else root
    for _ in range(passes):
        pids = descendants(root)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if root == me:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
        if not pids:
            return


def marked(marker: bytes) -> list[int]:
    """The processes of this user whose environment holds ``marker`` (``NAME=value``); none where
    there is no ``/proc``."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:  # gone, or another user's
                continue
    return found


def kill_marked(marker: bytes) -> None:
    """Kill what a harness left outside its process group: a child started in a session of
    its own (Node's ``detached``, ``setsid``) survives the group's kill, one per episode. Every
    descendant inherits the episode's own ``AGENTRL_SESSION_ID``, so that finds them; a few
    passes, for children forked meanwhile. The caller is spared."""
    me = os.getpid()
    for _ in range(3):
        pids = [p for p in marked(marker) if p != me]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _teardown(remove_cwd: bool) -> None:
    """The trainer is gone: its episode's directory and processes go too, this guard last."""
    if remove_cwd:
        import shutil

        with contextlib.suppress(OSError):
            shutil.rmtree(os.getcwd(), ignore_errors=True)
    kill_descendants()
    if sid := os.environ.get("AGENTRL_SESSION_ID"):
        kill_marked(f"AGENTRL_SESSION_ID={sid}".encode())
    os.killpg(0, signal.SIGKILL)


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; whether the kernel took it."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exec(cmd: list[str]) -> None:
    """In the forked child: become ``cmd``, or say why not and exit 127."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.execvp(cmd[0], cmd)
    except (OSError, ValueError) as e:  # execvp's error names no file: name it as Popen's does
        said = str(e) if getattr(e, "filename", None) else f"{e}: {cmd[0]!r}"
        os.write(2, f"{START_FAILED}{said}\n".encode(errors="replace"))
    os._exit(127)


def _exit_as(status: int) -> None:
    """Exit as a child that ended with wait ``status`` did: its code, or its signal."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)  # a signal that does not end a process


def main(argv: list[str]) -> None:
    """``TRAINER_PID [--remove-cwd] -- CMD...``: see the module docstring."""
    split = argv.index("--")
    trainer, remove_cwd, cmd = int(argv[0]), "--remove-cwd" in argv[1:split], argv[split + 1:]

    def on_death_signal(signum: int, frame: object) -> None:
        if os.getppid() != trainer:  # not the trainer's own SIGTERM: it died
            _teardown(remove_cwd)

    if os.getpgrp() != os.getpid():  # the teardown kills its group: never its caller's
        os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, on_death_signal)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != trainer:  # it died before the kernel was asked
        _teardown(remove_cwd)
    child = os.fork()
    if child == 0:
        _exec(cmd)
    _, status = os.waitpid(child, 0)  # retried across signals (PEP 475)
    kill_descendants()
    _exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
