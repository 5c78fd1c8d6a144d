"""Scale-out on Ray, behind the same interfaces as one process.

Ray is an execution detail, never a second code path (``docs/architecture.md``,
Principles: one config, two scales):

- ``env_workers``: ``rollout.env_executor: ray`` hosts envs (and their sandboxes)
  in env-worker actors, placed by CPUs and a ``sandbox_<backend>`` resource.
- ``rollout_workers``: ``RayPolicy`` load-balances generation over rollout-worker
  actors with prefix-cache affinity; weights go out through the object store
  (``agentrl.policy.for_run`` picks it when the config asks for rollout workers,
  so ``rollout``, ``eval`` and ``proxy serve`` honour the section as ``train`` does);
- ``ray_sampler``: asynchronous training's view of the rollout workers;
- ``weights``: the state dict as it goes to the workers (LoRA merged in);
- ``cluster``: joining the cluster ``distributed.ray`` names; Ray's errors mapped
  to agentrl's.

Ray is imported only when one of these is used (``pip install agentrl[ray]``).
"""

from .cluster import LOCAL_SYSTEM_CONFIG, connect
from .env_workers import (
    EnvWorker,
    EnvWorkerPool,
    RayEnv,
    env_resources,
    env_worker_options,
    env_worker_pool,
)
from .rollout_workers import (
    PrefixRouter,
    RayPolicy,
    RolloutWorker,
    placement,
)

__all__ = [
    "LOCAL_SYSTEM_CONFIG",
    "EnvWorker",
    "EnvWorkerPool",
    "PrefixRouter",
    "RayEnv",
    "RayPolicy",
    "RolloutWorker",
    "connect",
    "env_resources",
    "env_worker_options",
    "env_worker_pool",
    "placement",
]
