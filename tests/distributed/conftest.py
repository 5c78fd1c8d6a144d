"""The private Ray instance the distributed tests share, one per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster():
    """A private local Ray instance with 2 CPUs for the module's tests, shut down after them."""
    ray = pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")
    from agentrl.distributed import LOCAL_SYSTEM_CONFIG, env_workers

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG)
    try:
        yield ray
    finally:
        env_workers._POOLS.clear()  # env-worker pools of this instance die with it
        ray.shutdown()
