"""bash, python and the file tools, run in a real LocalSandbox."""

from __future__ import annotations

import asyncio
import posixpath

import pytest

from agentrl.errors import SandboxDeadError, ToolError
from agentrl.tools import PythonTool, get_tool
from tests.tools.sandbox_fakes import DeadSandbox, MemorySandbox


def call(name, args, box, tool=None):
    return asyncio.run((tool or get_tool(name)).invoke(args, box))


def test_bash_reports_stdout_stderr_and_exit_code(local_sandbox):
    res = call("bash", {"command": "echo out; echo err >&2; exit 3"}, local_sandbox)
    assert res.is_error
    assert res.content == "out\n[stderr]\nerr\n[exit code 3]"
    ok = call("bash", {"command": "printf 'a b'"}, local_sandbox)
    assert not ok.is_error and ok.content == "a b"
    assert call("bash", {"command": "true"}, local_sandbox).content == "(no output)"


def test_bash_timeout_is_reported(local_sandbox):
    res = call("bash", {"command": "sleep 5", "timeout": 0.3}, local_sandbox)
    assert res.is_error and "timed out after 0.3 s" in res.content
    assert res.metadata["timed_out"] is True


def test_bash_rejects_bad_arguments_readably(local_sandbox):
    res = call("bash", {"cmd": "ls"}, local_sandbox)
    assert res.is_error
    assert "- command: Field required" in res.content and "- cmd:" in res.content
    res = call("bash", {"command": "ls", "timeout": -1}, local_sandbox)
    assert res.is_error and "- timeout:" in res.content


def test_write_read_and_line_ranges(local_sandbox):
    w = call("write_file", {"path": "pkg/a.txt", "content": "one\ntwo\nthree\n"}, local_sandbox)
    assert not w.is_error and w.content == "wrote 14 bytes to pkg/a.txt"
    assert call("read_file", {"path": "pkg/a.txt"}, local_sandbox).content == "one\ntwo\nthree\n"
    part = call("read_file", {"path": "pkg/a.txt", "start_line": 2, "end_line": 2}, local_sandbox)
    assert part.content == "two\n"
    bad = call("read_file", {"path": "pkg/a.txt", "start_line": 9}, local_sandbox)
    assert bad.is_error and "out of range" in bad.content
    # the file really is in the sandbox, as the shell sees it
    assert call("bash", {"command": "cat pkg/a.txt | wc -l"}, local_sandbox).content == "3"


def test_file_errors_are_results_not_exceptions(local_sandbox):
    missing = call("read_file", {"path": "nope.txt"}, local_sandbox)
    assert missing.is_error and "nope.txt" in missing.content
    outside = call("read_file", {"path": "/etc/passwd"}, local_sandbox)
    assert outside.is_error and "outside the sandbox" in outside.content
    escape = call("write_file", {"path": "../x", "content": "x"}, local_sandbox)
    assert escape.is_error


def test_edit_file_replaces_a_unique_match(local_sandbox):
    call("write_file", {"path": "f.py", "content": "a = 1\nb = 2\n"}, local_sandbox)
    res = call("edit_file", {"path": "f.py", "search": "b = 2", "replace": "b = 3"}, local_sandbox)
    assert not res.is_error and res.metadata["replacements"] == 1
    assert call("read_file", {"path": "f.py"}, local_sandbox).content == "a = 1\nb = 3\n"


def test_edit_file_refuses_absent_and_ambiguous_search_text():
    box = MemorySandbox()
    box.files["f.py"] = b"x = 1\nx = 1\n"
    absent = call("edit_file", {"path": "f.py", "search": "y = 1", "replace": "z"}, box)
    assert absent.is_error and "not found" in absent.content
    twice = call("edit_file", {"path": "f.py", "search": "x = 1", "replace": "x = 2"}, box)
    assert twice.is_error and "occurs 2 times" in twice.content
    assert box.files["f.py"] == b"x = 1\nx = 1\n"  # nothing was written
    both = {"path": "f.py", "search": "x = 1", "replace": "x = 2", "replace_all": True}
    assert call("edit_file", both, box).metadata["replacements"] == 2
    assert box.files["f.py"] == b"x = 2\nx = 2\n"
    empty = call("edit_file", {"path": "f.py", "search": "", "replace": "q"}, box)
    assert empty.is_error and "- search:" in empty.content
    missing = call("edit_file", {"path": "g.py", "search": "a", "replace": "b"}, box)
    assert missing.is_error and "FileNotFoundError" in missing.content


def test_dead_sandbox_raises_instead_of_blaming_the_model():
    with pytest.raises(SandboxDeadError):
        call("read_file", {"path": "a"}, DeadSandbox())
    with pytest.raises(SandboxDeadError):
        call("bash", {"command": "ls"}, DeadSandbox())


def test_sandbox_tools_need_a_sandbox():
    with pytest.raises(ToolError, match="needs a sandbox"):
        call("bash", {"command": "ls"}, None)


def test_python_keeps_state_between_calls_and_reports_errors(local_sandbox):
    py = PythonTool()

    async def session():
        first = await py.invoke({"code": "import math\nx = 41"}, local_sandbox)
        second = await py.invoke({"code": "print(x + 1)\nmath.sqrt(16)"}, local_sandbox)
        boom = await py.invoke({"code": "1/0"}, local_sandbox)
        still = await py.invoke({"code": "print(x)"}, local_sandbox)
        await py.release(local_sandbox)
        fresh = await py.invoke({"code": "print('x' in globals())"}, local_sandbox)
        await py.release(local_sandbox)
        return first, second, boom, still, fresh

    first, second, boom, still, fresh = asyncio.run(session())
    assert not first.is_error
    assert second.content == "42\n4.0"
    assert boom.is_error and "ZeroDivisionError" in boom.content
    assert still.content == "41"
    assert fresh.content == "False"  # release dropped the session


@pytest.mark.parametrize("kill", ["import os\nos.kill(os.getppid(), 9)", "import os\nos.write(9, b'garbage\\n')"])
def test_python_code_that_kills_its_kernel_is_told_so_and_goes_on(local_sandbox, kill):
    """Killing the kernel itself (not the snippet's own process, which rolls back) or writing
    to its pipes raised SandboxDeadError: the episode failed as if the sandbox had died."""
    py = PythonTool()

    async def session():
        await py.invoke({"code": "x = 41"}, local_sandbox)
        died = await py.invoke({"code": kill}, local_sandbox)
        after = await py.invoke({"code": "print('x' in globals(), 6 * 7)"}, local_sandbox)
        await py.release(local_sandbox)
        return died, after

    died, after = asyncio.run(session())
    assert died.is_error and "kernel itself died or stopped answering" in died.content and died.metadata["kernel_lost"]
    assert after.content == "False 42" and not after.is_error  # a fresh kernel, its state gone


def test_python_kernel_death_with_no_fresh_kernel_fails_the_episode():
    """Where no fresh kernel starts, the sandbox itself is gone: not the model's to fix."""
    from agentrl.errors import SandboxError

    class Dying:
        def __init__(self, sandbox):
            self.starts = 0

        async def start(self):
            self.starts += 1
            if self.starts > 1:
                raise SandboxError("the Python kernel did not start within 60s")

        async def execute(self, code, timeout):
            raise SandboxDeadError("the Python kernel died")

    with pytest.raises(SandboxDeadError, match="a fresh kernel did not start either"):
        call("python", {"code": "1"}, MemorySandbox(), PythonTool(interpreter_factory=Dying))


def test_python_concurrent_calls_on_one_sandbox_are_serialized(local_sandbox):
    py = PythonTool()

    async def many():
        await py.invoke({"code": "n = 0"}, local_sandbox)
        await asyncio.gather(*(py.invoke({"code": "n += 1"}, local_sandbox) for _ in range(5)))
        out = await py.invoke({"code": "print(n)"}, local_sandbox)
        await py.release(local_sandbox)
        return out

    assert asyncio.run(many()).content == "5"


def test_python_output_is_capped(local_sandbox):
    py = PythonTool()
    py.max_output_chars = 500

    async def flood():
        out = await py.invoke({"code": "print('y' * 100000)"}, local_sandbox)
        await py.release(local_sandbox)
        return out

    res = asyncio.run(flood())
    assert len(res.content) < 600 and "characters truncated" in res.content


class SlowMemorySandbox(MemorySandbox):
    """Yields to the loop inside every file operation, as a real sandbox does."""

    async def read_file(self, path: str) -> bytes:
        await asyncio.sleep(0.01)
        return await super().read_file(posixpath.normpath(path))

    async def write_file(self, path: str, data: str | bytes) -> None:
        await asyncio.sleep(0.01)
        await super().write_file(posixpath.normpath(path), data)


def test_concurrent_edits_of_one_file_all_apply():
    box = SlowMemorySandbox()
    box.files["f.py"] = b"a = 1\nb = 1\nc = 1\nd = 1\n"
    edit = get_tool("edit_file")

    async def turn():
        calls = [
            edit.invoke({"path": p, "search": f"{v} = 1", "replace": f"{v} = 2"}, box)
            for v, p in zip("abcd", ["f.py", "./f.py", "f.py", "sub/../f.py"], strict=True)
        ]
        return await asyncio.gather(*calls)

    results = asyncio.run(turn())
    assert not any(r.is_error for r in results), [r.content for r in results]
    assert box.files["f.py"] == b"a = 2\nb = 2\nc = 2\nd = 2\n"


def test_edit_file_keeps_bytes_that_are_not_utf8():
    box = MemorySandbox()
    box.files["latin.txt"] = b"caf\xe9 = 1\nx = 1\n\xff\xfe end\n"
    res = call("edit_file", {"path": "latin.txt", "search": "x = 1", "replace": "x = 2"}, box)
    assert not res.is_error, res.content
    assert box.files["latin.txt"] == b"caf\xe9 = 1\nx = 2\n\xff\xfe end\n"
    shown = call("read_file", {"path": "latin.txt"}, box).content  # U+FFFD for display only
    copied = {"path": "latin.txt", "search": shown.splitlines()[0], "replace": "y"}
    refused = call("edit_file", copied, box)
    assert refused.is_error and "not UTF-8" in refused.content
    assert box.files["latin.txt"] == b"caf\xe9 = 1\nx = 2\n\xff\xfe end\n"
