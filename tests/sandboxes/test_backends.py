"""The Sandbox protocol behaves the same on every backend available here."""

from __future__ import annotations

import asyncio
import os

import pytest

from agentrl.errors import SandboxDeadError, SandboxError
from agentrl.sandboxes import LocalSandbox, SandboxLimits

pytestmark = pytest.mark.anyio


async def test_run_shell_string_and_argv(built):
    r = await built.sandbox.run("echo hello; echo oops >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("hello\n", "oops\n", 3, False)
    r = await built.sandbox.run(["printf", "%s|", "a b", "c"])
    assert (r.stdout, r.exit_code, r.ok) == ("a b|c|", 0, True)
    assert r.duration_s > 0


async def test_stdin_and_env_reach_the_command(built):
    r = await built.sandbox.run("cat; echo $GREETING", stdin="piped\n", env={"GREETING": "hi"})
    assert r.stdout == "piped\nhi\n"


async def test_parent_environment_does_not_leak(built, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_SECRET_TOKEN", "leak-me")
    r = await built.sandbox.run("env")
    assert "leak-me" not in r.stdout
    assert "PATH=" in r.stdout


async def test_run_python_uses_a_real_interpreter(built):
    r = await built.sandbox.run_python("import sys; print(sys.version_info[0])")
    assert r.stdout == "3\n", r


async def test_files_round_trip_and_are_visible_to_commands(built):
    await built.sandbox.write_file("dir/sub/data.bin", b"\x00\xffbinary")
    assert await built.sandbox.read_file("dir/sub/data.bin") == b"\x00\xffbinary"
    # /work is the workdir inside a namespace or container; a remote server in front of a plain
    # local sandbox (no bwrap here) has no /work either
    plain = built.inner.ISOLATION == "none"
    await built.sandbox.write_file("note.txt" if plain else "/work/note.txt", "hi")
    r = await built.sandbox.run("cat note.txt; ls dir/sub")
    assert r.stdout == "hidata.bin\n"
    await built.sandbox.run("echo made-inside > inside.txt")
    assert await built.sandbox.read_file("inside.txt") == b"made-inside\n"


@pytest.mark.parametrize("bad", ["../escape.txt", "a/../../escape.txt", "/etc/passwd", ""])
async def test_paths_outside_the_workdir_are_refused(built, bad):
    with pytest.raises(SandboxError):
        await built.sandbox.write_file(bad, "x")
    with pytest.raises(SandboxError):
        await built.sandbox.read_file(bad)


async def test_missing_file_read_raises(built):
    with pytest.raises(SandboxError):
        await built.sandbox.read_file("does-not-exist.txt")


async def test_read_file_refuses_a_file_over_max_bytes_naming_the_limit(built):
    await built.sandbox.write_file("ten.txt", b"0123456789")
    assert await built.sandbox.read_file("ten.txt", max_bytes=10) == b"0123456789"
    with pytest.raises(SandboxError, match="larger than 9 bytes"):
        await built.sandbox.read_file("ten.txt", max_bytes=9)
    with pytest.raises(SandboxError, match="max_bytes"):
        await built.sandbox.read_file("ten.txt", max_bytes=-1)


async def test_host_side_file_access_does_not_follow_planted_symlinks(built, tmp_path):
    target = tmp_path / "host-file.txt"
    target.write_text("original")
    await built.sandbox.run(f"ln -s {target} link.txt; ln -s {tmp_path} linkdir")
    with pytest.raises(SandboxError):
        await built.sandbox.write_file("link.txt", "overwritten")
    with pytest.raises(SandboxError):
        await built.sandbox.write_file("linkdir/new.txt", "x")
    assert target.read_text() == "original"
    assert not (tmp_path / "new.txt").exists()


async def test_reset_empties_the_workdir_and_keeps_working(built):
    await built.sandbox.write_file("keep.txt", "x")
    await built.sandbox.reset()
    r = await built.sandbox.run("ls -A")
    assert r.stdout == ""
    assert (await built.sandbox.run("echo again")).stdout == "again\n"


async def test_concurrent_runs_do_not_mix_output(built):
    results = await asyncio.gather(*(built.sandbox.run(f"echo {i}") for i in range(8)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


async def test_close_is_idempotent_and_final(builder, backend):
    async with builder(backend) as b:
        await b.sandbox.close()
        await b.sandbox.close()
        with pytest.raises(SandboxDeadError):
            await b.sandbox.run("true")


async def test_cpu_limit_stops_a_busy_process(builder, backend):
    if backend in ("docker", "gvisor"):
        pytest.skip(f"{backend}: CPU is shared by --cpus quota, not an RLIMIT_CPU budget")
    async with builder(backend, SandboxLimits(cpu_s=1, memory_mb=256, pids=64)) as b:
        r = await b.sandbox.run_python("while True:\n    pass\n", timeout=120)
    assert not r.timed_out
    assert r.exit_code != 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to a private uid needs root")
async def test_local_runs_as_private_unprivileged_uid():
    async with LocalSandbox() as sb:
        r = await sb.run("id -u")
        assert int(r.stdout) == sb.uid
        assert sb.uid >= 1_000_000
        async with LocalSandbox() as other:
            assert other.uid != sb.uid


async def test_snapshot_restore_brings_the_workdir_back(built):
    await built.sandbox.write_file("a/b.txt", "v1")
    snap = await built.sandbox.snapshot()
    await built.sandbox.write_file("a/b.txt", "v2")
    await built.sandbox.write_file("new.txt", "later")
    await built.sandbox.restore(snap)
    assert await built.sandbox.read_file("a/b.txt") == b"v1"
    assert (await built.sandbox.run("ls -A")).stdout == "a\n"
    assert (await built.sandbox.run("echo more >> a/b.txt && cat a/b.txt")).stdout == "v1more\n"
