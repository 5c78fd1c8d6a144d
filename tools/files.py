"""File tools: ``read_file``, ``write_file`` and ``edit_file`` (search and replace).

Paths are relative to the sandbox's working directory; the sandbox decides what
lies outside it. Mistakes the model can fix (a missing file, search text that is
absent or occurs more than once) come back as error results.

``edit_file`` works on bytes: only the matched bytes change, so a file that is
not UTF-8 keeps every byte the edit did not touch. An edit whose result would
pass ``MAX_FILE_BYTES`` is refused before it is built. Calls that write a path
(``write_file``, ``edit_file``) take a lock per sandbox and path, so concurrent
calls in one turn apply one after another instead of losing an edit.
"""

from __future__ import annotations

import asyncio
import inspect
import posixpath
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import SandboxError
from agentrl.sandboxes.base import Sandbox

from ._sandbox_errors import is_model_fixable, require_sandbox
from .base import Tool, ToolResult

__all__ = [
    "EditFileArgs",
    "EditFileTool",
    "ReadFileArgs",
    "ReadFileTool",
    "WriteFileArgs",
    "WriteFileTool",
]

MAX_FILE_BYTES = 5_000_000  # edit_file and read_file refuse bigger files


class ReadFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="File path, relative to the working directory.")
    start_line: int = Field(1, ge=1, description="First line to return (1-based).")
    end_line: int | None = Field(None, ge=1, description="Last line to return; default: the end.")


class WriteFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="File path, relative to the working directory.")
    content: str = Field(description="Full new content of the file.")


class EditFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="File path, relative to the working directory.")
    search: str = Field(min_length=1, description="Exact text to find; must occur exactly once.")
    replace: str = Field(description="Text that replaces it.")
    replace_all: bool = Field(False, description="Replace every occurrence instead of one.")


# sandbox -> path -> (lock, number of calls holding or waiting for it)
_path_locks: weakref.WeakKeyDictionary[Sandbox, dict[str, list]] = weakref.WeakKeyDictionary()


@asynccontextmanager
async def _locked(sandbox: Sandbox, path: str) -> AsyncIterator[None]:
    """Hold the lock of ``path`` in ``sandbox``; dropped when no call needs it (locks
    belong to one event loop, and a sandbox may be used from several in turn)."""
    key = posixpath.normpath(path)
    locks = _path_locks.setdefault(sandbox, {})
    entry = locks.setdefault(key, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        async with entry[0]:
            yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del locks[key]


def _describe(err: BaseException, verb: str, path: str) -> str:
    # Sandbox errors already name the path and the reason.
    if isinstance(err, SandboxError):
        return str(err)
    return f"cannot {verb} {path!r}: {type(err).__name__}: {err}"


def _takes_max_bytes(sandbox: Sandbox) -> bool:
    """Whether ``sandbox.read_file`` takes ``max_bytes`` (sandboxes written before it do not)."""
    try:
        return "max_bytes" in inspect.signature(sandbox.read_file).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


async def _read_bytes(sandbox: Sandbox, path: str) -> bytes | ToolResult:
    """The file's bytes, or an error result the model can act on.

    The sandbox is asked for at most ``MAX_FILE_BYTES``, so a huge file is refused
    there, never read whole into this process first."""
    try:
        if _takes_max_bytes(sandbox):
            data = await sandbox.read_file(path, max_bytes=MAX_FILE_BYTES)
        else:
            data = await sandbox.read_file(path)
    except Exception as err:
        if not is_model_fixable(err):
            raise
        return ToolResult.error(_describe(err, "read", path))
    if len(data) > MAX_FILE_BYTES:
        return ToolResult.error(f"{path!r} is larger than {MAX_FILE_BYTES} bytes")
    return data


async def _write(sandbox: Sandbox, path: str, data: str | bytes) -> ToolResult | None:
    try:
        await sandbox.write_file(path, data)
    except Exception as err:
        if not is_model_fixable(err):
            raise
        return ToolResult.error(_describe(err, "write", path))
    return None


class ReadFileTool(Tool):
    name: ClassVar[str] = "read_file"
    description: ClassVar[str] = "Read a text file, optionally only lines start_line..end_line."
    Args: ClassVar[type[BaseModel]] = ReadFileArgs
    needs_sandbox: ClassVar[bool] = True

    async def __call__(self, args: ReadFileArgs, sandbox: Sandbox | None) -> ToolResult:
        data = await _read_bytes(require_sandbox(sandbox, self.name), args.path)
        if isinstance(data, ToolResult):
            return data
        text = data.decode("utf-8", errors="replace")  # for display; edit_file keeps the bytes
        if args.start_line == 1 and args.end_line is None:
            return ToolResult(content=text)
        lines = text.splitlines(keepends=True)
        end = args.end_line if args.end_line is not None else len(lines)
        if args.start_line > max(len(lines), 1) or end < args.start_line:
            return ToolResult.error(
                f"lines {args.start_line}..{end} are out of range; {args.path!r} has "
                f"{len(lines)} lines"
            )
        return ToolResult(content="".join(lines[args.start_line - 1 : end]))


class WriteFileTool(Tool):
    name: ClassVar[str] = "write_file"
    description: ClassVar[str] = "Create or overwrite a text file with the given content."
    Args: ClassVar[type[BaseModel]] = WriteFileArgs
    needs_sandbox: ClassVar[bool] = True

    async def __call__(self, args: WriteFileArgs, sandbox: Sandbox | None) -> ToolResult:
        box = require_sandbox(sandbox, self.name)
        async with _locked(box, args.path):
            failed = await _write(box, args.path, args.content)
        n = len(args.content.encode())
        return failed or ToolResult(content=f"wrote {n} bytes to {args.path}")


class EditFileTool(Tool):
    name: ClassVar[str] = "edit_file"
    description: ClassVar[str] = (
        "Replace an exact piece of text in a file. The search text must occur exactly once "
        "(include surrounding lines to make it unique) unless replace_all is true."
    )
    Args: ClassVar[type[BaseModel]] = EditFileArgs
    needs_sandbox: ClassVar[bool] = True

    async def __call__(self, args: EditFileArgs, sandbox: Sandbox | None) -> ToolResult:
        box = require_sandbox(sandbox, self.name)
        async with _locked(box, args.path):
            return await self._edit(box, args)

    async def _edit(self, box: Sandbox, args: EditFileArgs) -> ToolResult:
        data = await _read_bytes(box, args.path)
        if isinstance(data, ToolResult):
            return data
        search, replace = args.search.encode(), args.replace.encode()
        count = data.count(search)
        if count == 0 and "\ufffd" in args.search:
            return ToolResult.error(
                f"the search text holds U+FFFD, which read_file shows for bytes of {args.path!r} "
                "that are not UTF-8; choose search text without those characters"
            )
        if count == 0:
            return ToolResult.error(
                f"the search text was not found in {args.path!r}; read the file and copy the "
                "text exactly, including whitespace"
            )
        if count > 1 and not args.replace_all:
            return ToolResult.error(
                f"the search text occurs {count} times in {args.path!r}; include more "
                "surrounding text to make it unique, or set replace_all to true"
            )
        n = count if args.replace_all else 1
        size = len(data) + n * (len(replace) - len(search))
        if size > MAX_FILE_BYTES:  # checked before the bytes are built: they may not fit in memory
            return ToolResult.error(
                f"the edit would make {args.path!r} {size:,} bytes, over the {MAX_FILE_BYTES} "
                "bytes the file tools handle; replace fewer occurrences or shorter text"
            )
        new = data.replace(search, replace, n)
        failed = await _write(box, args.path, new)
        return failed or ToolResult(
            content=f"replaced {n} occurrence(s) in {args.path}",
            metadata={"replacements": n},
        )
