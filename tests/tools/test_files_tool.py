"""The file tools read a bounded number of bytes: a huge file is refused without ever
being held whole in the trainer's memory."""

from __future__ import annotations

import asyncio
import tracemalloc

from agentrl.errors import SandboxError
from agentrl.sandboxes import LocalSandbox, SandboxLimits
from agentrl.tools import get_tool
from agentrl.tools.files import MAX_FILE_BYTES
from tests.tools.sandbox_fakes import MemorySandbox


def call(name, args, box):
    return asyncio.run(get_tool(name).invoke(args, box))


class BoundedSandbox(MemorySandbox):
    """In-memory files; records the ``max_bytes`` each read was given and honours it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int | None] = []

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self.asked.append(max_bytes)
        data = await super().read_file(path)
        if max_bytes is not None and len(data) > max_bytes:
            raise SandboxError(f"{path!r} is larger than {max_bytes} bytes")
        return data[: max_bytes + 1] if max_bytes is not None else data


def test_read_and_edit_ask_the_sandbox_for_at_most_the_tools_limit():
    box = BoundedSandbox()
    box.files["a.txt"] = b"x = 1\n"
    assert call("read_file", {"path": "a.txt"}, box).content == "x = 1\n"
    edit = call("edit_file", {"path": "a.txt", "search": "1", "replace": "2"}, box)
    assert not edit.is_error, edit
    assert box.asked == [MAX_FILE_BYTES, MAX_FILE_BYTES]


def test_a_sandbox_whose_read_takes_no_limit_still_gets_the_size_check():
    box = MemorySandbox()  # read_file(path) only, as sandboxes written before the limit
    box.files["big"] = b"x" * (MAX_FILE_BYTES + 1)
    res = call("read_file", {"path": "big"}, box)
    assert res.is_error and str(MAX_FILE_BYTES) in res.content


def test_a_huge_sparse_file_is_refused_without_reading_it_into_memory():
    # 500 MiB of holes: the sandbox read up to fsize_mb (here 1 GiB) into the trainer's
    # memory before the tool's 5 MB check.
    async def scenario() -> tuple[object, int]:
        async with LocalSandbox(SandboxLimits(fsize_mb=1024)) as box:
            made = await box.run("truncate -s 500M big && echo made")
            assert made.stdout == "made\n", made
            tracemalloc.start()
            try:
                res = await get_tool("read_file").invoke({"path": "big"}, box)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            return res, peak

    res, peak = asyncio.run(scenario())
    assert res.is_error and str(MAX_FILE_BYTES) in res.content, res
    assert peak < 3 * MAX_FILE_BYTES, f"peak {peak} bytes while refusing a 500 MiB file"


def test_an_edit_whose_result_would_pass_the_file_limit_is_refused_before_it_is_built():
    # replace_all of one byte by 200 KB in a 1 MB file built 200 GB in the trainer's memory.
    box = MemorySandbox()
    box.files["a.txt"] = b"a" * 1_000_000
    res = call("edit_file", {"path": "a.txt", "search": "a", "replace": "b" * 200_000,
                             "replace_all": True}, box)
    assert res.is_error and "200,000,000,000 bytes" in res.content and str(MAX_FILE_BYTES) in res.content
    assert box.files["a.txt"] == b"a" * 1_000_000
    # One that stays within the limit is made.
    box.files["b.txt"] = b"ab" * 10
    res = call("edit_file", {"path": "b.txt", "search": "a", "replace": "xyz", "replace_all": True}, box)
    assert not res.is_error and box.files["b.txt"] == b"xyzb" * 10
