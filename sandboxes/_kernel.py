"""The persistent-interpreter worker that runs INSIDE a sandbox (stdlib only).

It is shipped as source text (``python3 -I -c <this file>``), never imported by
the host. Protocol: one JSON request per stdin line, one JSON reply per stdout line.
Every request carries an ``id`` that its reply echoes. The host sends nothing
while a snippet runs except ``{"op": "cancel", "id": n}``, so any input that
arrives then stops the snippet (killed, state rolled back, reply marked
``cancelled``). A cancel is always acknowledged, after the snippet's reply, with
``{"cancel_ack": n, "promoted": ...}`` (whether the snippet finished first and
its changes were kept, which the host may not learn from a lost reply): the
host reads up to that line and is in step again.
Snippets get ``/dev/null`` as stdin; the protocol pipes are fds 8 and 9.

Process layout and state semantics ("fork and promote"):

    top (the started process; child subreaper, reaps zombies, never runs code)
     └─ kernel K holds the namespace and reads requests
         └─ child C: forked per snippet, runs it in its own process group

If C finishes the snippet (also with an exception or ``sys.exit``), C *becomes*
the kernel, keeping every change the snippet made, and K exits. C waits for K to
reply and exit before it reads a request (a K that died unreplied, killed by the
snippet, ends the chain: the host reads EOF instead of waiting for a reply), so exactly one process reads the protocol pipe at
any moment: a cancel that K takes always reaches the process that acts on it. If C dies
(``os._exit``, a signal, a segfault) or passes its timeout (K kills C's whole
process group), K stays the kernel: the state is exactly as before the snippet.
"""

import ast
import builtins
import ctypes
import json
import os
import select
import signal
import sys
import time
import traceback

__all__ = []  # a script, not a library

PROTO_IN = 8  # dup of the original stdin; fd 0 is /dev/null for snippets
PROTO_OUT = 9  # dup of the original stdout; fds 1/2 are reserved for snippet output
_buf = [b""]
_last = [None, False]  # the id of the last request run, and whether its changes were kept


def read_request():
    while True:
        while b"\n" not in _buf[0]:
            chunk = os.read(PROTO_IN, 1 << 16)
            if not chunk:
                return None
            _buf[0] += chunk
        line, _buf[0] = _buf[0].split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:  # not a request; the host times out waiting and restarts us
            continue


def reply(obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(PROTO_OUT, data) :]


def run_snippet(code, ns):
    """Run like a REPL cell: the value of a final expression is printed. Returns exit code."""
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), ns)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        etype, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
            tb = tb.tb_next  # hide the kernel's own frames
        traceback.print_exception(etype, value, tb)
        return 1


def child_runs(code, w_out, w_err, w_st, r_go, ns):
    """In C: run the snippet, report, wait for K's hand-over, then become the kernel."""
    os.setpgid(0, 0)
    os.dup2(w_out, 1)
    os.dup2(w_err, 2)
    os.close(w_out)
    os.close(w_err)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Line-buffered: what a snippet printed before a timeout's or a crash's kill is in the pipe
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    exit_code = run_snippet(code, ns)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    # One line, in one write: K takes it whole (a child the snippet forked may hold w_st open).
    os.write(w_st, (json.dumps({"exit_code": exit_code}) + "\n").encode())
    os.close(w_st)
    # K either replies, says so on the go pipe and exits (C is the kernel now), or kills
    # this process group, if a cancel reached it first.
    handed = b""
    while chunk := os.read(r_go, 1):
        handed += chunk
    os.close(r_go)
    if not handed:  # K died unreplied (the snippet killed it): no one answers this request, so
        os._exit(0)  # end the chain; the host reads EOF at once instead of waiting out the timeout


def kill_group(pid):
    """Kill C's process group, and C itself: a snippet may have left its group for K's
    (C is not reaped yet, so its pid is still its own)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def c_exit_fd(pid):
    """A pidfd of C, readable once C has exited (None where the OS or Python has none)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def collect(pid, r_out, r_err, r_st, timeout, limit):
    """In K: gather C's output (bounded) until it promotes, dies, times out or is cancelled."""
    bufs = {r_out: bytearray(), r_err: bytearray()}
    truncated, status, timed_out, cancelled = False, b"", False, False
    open_fds = [r_out, r_err, r_st]
    exited = c_exit_fd(pid)
    deadline = time.monotonic() + timeout
    while r_st in open_fds and not status.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            kill_group(pid)
            break
        watched = [*open_fds, PROTO_IN] + ([exited] if exited is not None else [])
        ready, _, _ = select.select(watched, [], [], left)
        if PROTO_IN in ready:  # only a cancel arrives mid-snippet; K stays the kernel
            chunk = os.read(PROTO_IN, 1 << 16)  # K is the pipe's only reader until it exits
            kill_group(pid)  # C may have reported already: it waits for K, so it loses the race
            if not chunk:  # the host is gone
                os._exit(0)
            _buf[0] += chunk
            cancelled = True
            break
        for fd in ready:
            if fd == exited:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
            elif fd == r_st:
                status += chunk
            else:
                room = limit - len(bufs[fd])
                bufs[fd] += chunk[: max(room, 0)]
                truncated = truncated or len(chunk) > room
        if exited in ready and not status.endswith(b"\n"):
            break  # C died without reporting: a crash, whoever still holds r_st open
    if exited is not None:
        os.close(exited)
    # C flushed before reporting; take what is already in the pipes, never wait for the
    # EOF of any of them: background processes the snippet forked hold them open too.
    for fd in (r_out, r_err):
        while fd in open_fds and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            room = limit - len(bufs[fd])
            bufs[fd] += chunk[: max(room, 0)]
            truncated = truncated or len(chunk) > room
    for fd in (r_out, r_err, r_st):
        os.close(fd)
    out = bufs[r_out].decode("utf-8", "replace")
    err = bufs[r_err].decode("utf-8", "replace")
    return out, err, truncated, status, timed_out, cancelled


def kernel(ns):
    while True:
        req = read_request()
        if req is None:
            os._exit(0)
        if req.get("op") == "ping":
            reply({"pong": os.getpid(), "id": req.get("id")})
            continue
        if req.get("op") == "cancel":  # its snippet has replied (finished or killed)
            rid = req.get("id")
            reply({"cancel_ack": rid, "promoted": _last[0] == rid and _last[1]})
            continue
        started = time.monotonic()
        _last[:] = [req.get("id"), False]
        if _buf[0]:  # its cancel came with it: never start the snippet
            reply({"id": req.get("id"), "cancelled": True, "promoted": False, "exit_code": -1})
            continue
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        r_st, w_st = os.pipe()
        r_go, w_go = os.pipe()  # K holds the write end until it exits: C's go-ahead
        rnd = sys.modules.get("random")
        seeded = rnd.getstate() if rnd is not None else None
        pid = os.fork()
        if pid == 0:
            for fd in (r_out, r_err, r_st, w_go):
                os.close(fd)
            if seeded is not None:  # undo random's reseed after fork: cells share one stream
                rnd.setstate(seeded)
            child_runs(req["code"], w_out, w_err, w_st, r_go, ns)
            _last[1] = True
            continue  # C is now the kernel
        for fd in (w_out, w_err, w_st, r_go):
            os.close(fd)
        try:  # C does this too; doing it here as well means a cancel can never miss C's group
            os.setpgid(pid, pid)
        except OSError:
            pass
        out, err, truncated, status, timed_out, cancelled = collect(
            pid, r_out, r_err, r_st, float(req.get("timeout", 30)), int(req.get("limit", 1 << 20))
        )
        result = {"stdout": out, "stderr": err, "truncated": truncated, "timed_out": timed_out}
        result.update(id=req.get("id"), cancelled=cancelled, duration_s=time.monotonic() - started)
        if status and not (timed_out or cancelled):
            result.update(json.loads(status), promoted=True)
            reply(result)
            os.write(w_go, b"k")  # replied: C carries on as the kernel
            os._exit(0)
        _, wstatus = os.waitpid(pid, 0)
        os.close(w_go)
        sig = os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else 0
        result["exit_code"] = 128 + sig if sig else os.WEXITSTATUS(wstatus)
        result["promoted"] = False
        reply(result)


def main():
    os.dup2(0, PROTO_IN, inheritable=False)  # fork keeps them; commands a snippet runs do not
    os.dup2(1, PROTO_OUT, inheritable=False)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:  # PR_SET_CHILD_SUBREAPER: orphaned kernels are reaped here, not left as zombies
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
    except Exception:
        pass
    kid = os.fork()
    if kid == 0:
        ns = {"__name__": "__main__", "__builtins__": builtins}
        reply({"ready": True, "python": sys.version.split()[0]})
        kernel(ns)
        os._exit(0)
    os.close(PROTO_IN)
    os.close(PROTO_OUT)
    # Exit once the kernel chain is gone; orphans re-parent here and are reaped.
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue


if __name__ == "__main__":
    main()
