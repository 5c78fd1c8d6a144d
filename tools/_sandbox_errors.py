"""Which sandbox failures a tool reports to the model and which fail the episode."""

from __future__ import annotations

from agentrl.errors import SandboxDeadError, SandboxError, SandboxUnavailableError, ToolError
from agentrl.sandboxes.base import ExecResult, Sandbox

__all__ = ["format_exec", "is_model_fixable", "require_sandbox"]


def require_sandbox(sandbox: Sandbox | None, tool_name: str) -> Sandbox:
    """``sandbox``, or a ``ToolError`` saying the env gave this tool none."""
    if sandbox is None:
        raise ToolError(f"tool {tool_name!r} needs a sandbox; give ToolEnv a sandbox or a factory, "
                        "e.g. sandbox=lambda: make_sandbox(\"auto\") (agentrl.sandboxes)")
    return sandbox


def is_model_fixable(err: BaseException) -> bool:
    """True for errors the model caused and can fix (a missing file, a bad path).

    A dead or unavailable sandbox is not the model's fault: it fails the episode.
    """
    if isinstance(err, SandboxDeadError | SandboxUnavailableError):
        return False
    return isinstance(err, OSError | UnicodeError | SandboxError | ValueError)


def format_exec(result: ExecResult, timeout: float) -> str:
    """One text block of what a command printed and how it ended."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[timed out after {timeout:g} s and was killed]")
    elif result.oom_killed:
        parts.append("[killed: out of memory]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    if result.truncated:
        parts.append("[output truncated by the sandbox]")
    return "\n".join(parts) if parts else "(no output)"
