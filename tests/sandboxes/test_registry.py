"""make_sandbox never downgrades isolation, and says what to install."""

from __future__ import annotations

import warnings

import pytest

import agentrl.sandboxes as sb
import agentrl.sandboxes.base as base
import agentrl.sandboxes.registry as registry
from agentrl.errors import ConfigError, SandboxUnavailableError
from agentrl.sandboxes import (
    BACKENDS,
    BwrapSandbox,
    available_backends,
    check_backend,
    isolation_at_least,
    make_sandbox,
)
from agentrl.sandboxes.base import IsolationWarning
from agentrl.sandboxes.registry import describe_backends


def test_public_names_are_importable():
    for name in sb.__all__:
        assert hasattr(sb, name), name


def test_isolation_order():
    assert isolation_at_least("container", "namespaces")
    assert not isolation_at_least("none", "namespaces")
    assert isolation_at_least("gvisor", "container")


def test_unknown_backend_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'docker'"):
        make_sandbox("dokcer")


def test_asking_more_isolation_than_the_backend_gives_fails_loudly():
    with pytest.raises(SandboxUnavailableError, match="less than the asked 'container'"):
        make_sandbox("local", isolation="container")
    with pytest.raises(ConfigError, match="unknown level"):
        make_sandbox("local", isolation="total")


def test_local_is_always_available():
    assert "local" in available_backends()


def _only_available(monkeypatch, *names: str) -> None:
    """Make the registry see exactly ``names`` as runnable, with cheap stand-in classes."""

    def check(name: str) -> None:
        if name not in names:
            raise SandboxUnavailableError(f"{name} is off in this test")

    monkeypatch.setattr(registry, "check_backend", check)
    for name, cls in list(BACKENDS.items()):
        fake = type(f"Fake{cls.__name__}", (), {"ISOLATION": cls.ISOLATION, "NAME": name})
        monkeypatch.setitem(BACKENDS, name, fake)
    monkeypatch.setattr(base, "_warned", set())


def test_auto_picks_bwrap_over_local_and_docker(monkeypatch):
    _only_available(monkeypatch, "local", "bwrap", "docker")
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)
        assert make_sandbox("auto").NAME == "bwrap"
        assert make_sandbox("auto", isolation="namespaces").NAME == "bwrap"
    assert make_sandbox("auto", isolation="container").NAME == "docker"


def test_auto_falls_back_to_local_and_warns_that_it_is_unisolated(monkeypatch):
    _only_available(monkeypatch, "local", "docker")
    with pytest.warns(IsolationWarning, match="picked 'local'.*bwrap is off"):
        assert make_sandbox("auto").NAME == "local"


def test_auto_refuses_when_nothing_gives_the_isolation_asked(monkeypatch):
    _only_available(monkeypatch, "local")
    with pytest.raises(SandboxUnavailableError, match="isolation 'namespaces'.*bwrap is off"):
        make_sandbox("auto", isolation="namespaces")


def test_auto_gives_bwrap_on_this_machine_when_bwrap_runs():
    try:
        check_backend("bwrap")
    except SandboxUnavailableError as e:
        print(f"SKIPPED: {e}")
        pytest.skip(str(e))
    assert isinstance(make_sandbox("auto"), BwrapSandbox)


def test_describe_backends_says_what_each_enforces_or_why_not():
    described = describe_backends()
    assert set(described) == set(BACKENDS)
    assert described["local"].startswith("isolation none")
    assert "seccomp" in described["bwrap"] or "unavailable" in described["bwrap"]


def test_every_backend_declares_an_isolation_level():
    for name, cls in BACKENDS.items():
        assert cls.ISOLATION in ("none", "namespaces", "container", "gvisor", "remote"), name


def test_missing_bwrap_names_the_package(monkeypatch):
    import agentrl.sandboxes.bwrap as bw

    monkeypatch.setattr(bw, "bwrap_path", lambda: None)
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        bw.BwrapSandbox()


def test_missing_docker_engine_says_how_to_start_one(monkeypatch):
    from agentrl.sandboxes import docker as dk

    monkeypatch.setenv("AGENTRL_DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailableError, match="sandbox-setup.sh"):
        dk.docker_client()


@pytest.mark.anyio
async def test_auto_without_bwrap_runs_in_a_real_local_sandbox(monkeypatch):
    monkeypatch.setattr(registry, "_check_bwrap_cached", lambda: "bubblewrap is missing (test)")
    monkeypatch.setattr(base, "_warned", set())
    with pytest.warns(IsolationWarning, match="bubblewrap is missing"):
        box = make_sandbox("auto")
    async with box:
        assert box.NAME == "local"
        assert (await box.run("echo ok")).stdout == "ok\n"
