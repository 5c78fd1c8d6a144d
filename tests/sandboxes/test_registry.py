"""make_sandbox never downgrades isolation, and says what to install."""

from __future__ import annotations

import pytest

import agentrl.sandboxes as sb
from agentrl.errors import ConfigError, SandboxUnavailableError
from agentrl.sandboxes import (
    BACKENDS,
    LocalSandbox,
    available_backends,
    isolation_at_least,
    make_sandbox,
)


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


def test_local_is_always_available_and_auto_picks_it_for_no_isolation():
    assert "local" in available_backends()
    assert isinstance(make_sandbox("auto"), LocalSandbox)


def test_auto_gives_at_least_what_is_asked_or_explains():
    try:
        box = make_sandbox("auto", isolation="namespaces")
    except SandboxUnavailableError as e:
        assert "namespaces" in str(e)
    else:
        assert isolation_at_least(box.ISOLATION, "namespaces")


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
