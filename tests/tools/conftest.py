"""Fixtures for the tool tests: a real ``LocalSandbox``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentrl.sandboxes.base import Sandbox


@pytest.fixture
def local_sandbox() -> Iterator[Sandbox]:
    """A real ``LocalSandbox``, closed after the test (its loop-bound parts are lazy)."""
    from agentrl.sandboxes.local import LocalSandbox

    box = LocalSandbox()
    yield box
    asyncio.run(box.close())
