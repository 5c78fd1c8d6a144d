"""Sandbox backends behind one async protocol.

    make_sandbox("local" | "bwrap" | "docker" | "gvisor" | "remote" | "auto",
                 isolation=None | "none" | "namespaces" | "container" | "gvisor", **kwargs)

Backends (isolation): ``local`` (none), ``bwrap`` (namespaces), ``docker``
(container), ``gvisor`` (gvisor: docker with the runsc runtime), ``remote``
(whatever the server runs; checked on connect). A persistent
``PythonInterpreter`` runs inside any of them; ``SandboxPool`` keeps warm ones.
The HTTP server lives in ``agentrl.sandboxes.server`` (needs fastapi, uvicorn).
"""

from .base import (
    ISOLATION_ORDER,
    ExecResult,
    Isolation,
    IsolationWarning,
    Sandbox,
    SandboxLimits,
    SandboxProcess,
    isolation_at_least,
)
from .bwrap import BwrapSandbox
from .docker import DockerSandbox, GvisorSandbox, build_image
from .interpreter import PythonInterpreter
from .local import LocalSandbox
from .pool import PoolStats, SandboxPool
from .registry import (
    AUTO_ORDER,
    BACKENDS,
    available_backends,
    check_backend,
    describe_backends,
    make_sandbox,
    unavailable_reasons,
)
from .remote import RemoteSandbox
from .tar_filter import restore_filter

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "ISOLATION_ORDER",
    "BwrapSandbox",
    "DockerSandbox",
    "ExecResult",
    "GvisorSandbox",
    "Isolation",
    "IsolationWarning",
    "LocalSandbox",
    "PoolStats",
    "PythonInterpreter",
    "RemoteSandbox",
    "Sandbox",
    "SandboxLimits",
    "SandboxPool",
    "SandboxProcess",
    "available_backends",
    "build_image",
    "check_backend",
    "describe_backends",
    "isolation_at_least",
    "make_sandbox",
    "restore_filter",
    "unavailable_reasons",
]
