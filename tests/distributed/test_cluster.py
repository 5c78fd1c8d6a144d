"""``distributed.ray: auto`` joins only what it should: RAY_ADDRESS, then the cluster ``ray start``
recorded, else a private instance; never another program's ``ray.init()`` instance."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from agentrl.config import DistributedConfig
from agentrl.distributed import cluster
from agentrl.distributed.cluster import LOCAL, cluster_address, recorded_cluster_file
from agentrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
_WAIT_S = 180  # a subprocess starting or joining Ray on a loaded 2-core machine


def test_auto_reads_ray_address_then_the_ray_start_record_else_starts_its_own():
    assert cluster_address("auto", {"RAY_ADDRESS": "10.0.0.1:6379"}, "10.0.0.2:6379")[0] == "10.0.0.1:6379"
    assert cluster_address("auto", {}, "10.0.0.2:6379")[0] == "10.0.0.2:6379"
    assert cluster_address("auto", {"RAY_ADDRESS": " "}, None)[0] == LOCAL
    assert cluster_address("auto", {"RAY_ADDRESS": "auto"}, None)[0] == LOCAL  # Ray's scan: not ours
    assert cluster_address("10.0.0.3:6379", {"RAY_ADDRESS": "10.0.0.1:6379"}, "x")[0] == "10.0.0.3:6379"


def test_the_record_file_is_where_ray_start_writes_it(monkeypatch, tmp_path):
    pytest.importorskip("ray")
    from ray._common.utils import get_ray_address_file

    for env in ({"RAY_TMPDIR": str(tmp_path)}, {"TMPDIR": str(tmp_path / "t")}, {}):
        for var in ("RAY_TMPDIR", "TMPDIR"):
            monkeypatch.delenv(var, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert recorded_cluster_file(os.environ) == Path(get_ray_address_file(None))


def test_an_address_that_does_not_answer_fails_at_once_naming_the_key(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init({kw}) would retry for minutes"))
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:1 \(distributed\.ray=127\.0\.0\.1:1\)"):
        cluster.connect(DistributedConfig(ray="127.0.0.1:1"))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="from RAY_ADDRESS=127.0.0.1:1"):
        cluster.connect(DistributedConfig())


_HOLDER = textwrap.dedent("""
    import sys, ray
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # a bare init: its own instance
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes stdin
""")
_CONNECT = textwrap.dedent("""
    import os
    from agentrl.config import DistributedConfig
    from agentrl.distributed import connect
    ray = connect(DistributedConfig())
    niceness = ray.get(ray.remote(lambda: os.nice(0)).remote())
    print(ray.get_runtime_context().gcs_address, niceness, flush=True)
""")


def _env(tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TMPDIR")}
    return {**env, "RAY_TMPDIR": tmp, "PYTHONPATH": str(ROOT)}


def _connect(tmp: str) -> tuple[str, int]:
    """The GCS address a fresh process's ``connect(DistributedConfig())`` ends up on, and the
    niceness its tasks run at."""
    run = subprocess.run([sys.executable, "-c", _CONNECT], capture_output=True, text=True, env=_env(tmp),
                         timeout=_WAIT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    address, niceness = run.stdout.split()
    return address, int(niceness)


def test_auto_never_joins_another_programs_private_instance():
    """Another program's bare ``ray.init()`` runs on this machine: ``connect()`` with the
    default ``auto`` starts its own instance (a different GCS). Once ``ray start`` has
    recorded that cluster, ``auto`` joins it (the record is written by hand here: ``ray
    start`` would leave a cluster running, and ``ray stop`` stops every Ray process here)."""
    pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="agentrl-ray-", dir="/tmp")  # a short path: Ray's sockets live there
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=_env(tmp))
    try:
        theirs = holder.stdout.readline().strip()
        assert theirs, "the other program's ray.init() did not start"
        own, niceness = _connect(tmp)
        assert own != theirs  # a private instance, not the other program's
        assert niceness == 0  # its workers are not starved beside busy processes (Ray's default: 15)
        record = Path(tmp) / "ray" / "ray_current_cluster"
        record.write_text(theirs)
        assert _connect(tmp)[0] == theirs  # the `ray start` record is joined
    finally:
        holder.stdin.close()
        holder.wait(timeout=_WAIT_S)


def test_capacity_counts_whole_actors_per_node():
    from agentrl.distributed.cluster import capacity

    nodes = [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 4.0}]
    assert capacity(nodes, {"CPU": 1.5}) == 1 + 2  # 0.5 CPU left on the first node is no worker
    assert capacity(nodes, {"CPU": 1.0, "GPU": 1.0}) == 1  # the GPU node only
    assert capacity(nodes, {"CPU": 0.25}) == 8 + 16
    assert capacity(nodes, {"CPU": 1.0, "sandbox_docker": 1.0}) == 0
    assert capacity([], {"CPU": 1.0}) == 0


def test_two_threads_connecting_at_once_init_ray_once(monkeypatch):
    """``connect`` from two threads at once (a trainer's env pool and its rollout workers, say)
    must start one instance: both saw ``is_initialized()`` false and both called ``ray.init``."""
    import threading
    import time

    ray = pytest.importorskip("ray")
    inits: list[dict] = []
    state = {"up": False}

    def init(**kw):
        inits.append(kw)
        time.sleep(0.2)  # Ray takes seconds to start: the other thread checks meanwhile
        state["up"] = True

    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(cluster, "_recorded", lambda environ: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    threads = [threading.Thread(target=cluster.connect, args=(DistributedConfig(),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(inits) == 1


def test_room_is_counted_per_node_as_an_actor_fits_on_one(monkeypatch):
    """Two nodes with 2 free CPUs each have 4 free in all, but no room for one worker of 4 CPUs:
    the sum passed, and the worker would have waited for good."""
    from types import SimpleNamespace

    free = {"n1": {"CPU": 2.0}, "n2": {"CPU": 2.0}}
    fake = SimpleNamespace(available_resources=lambda: {"CPU": 4.0},
                           nodes=lambda: [{"Alive": True, "Resources": {"CPU": 4.0}}] * 2,
                           _private=SimpleNamespace(state=SimpleNamespace(
                               available_resources_per_node=lambda: free)))
    monkeypatch.setattr(cluster, "ROOM_WAIT_S", 0.0)
    with pytest.raises(ConfigError, match="per node"):
        cluster.wait_for_room(fake, {"CPU": 4.0}, "env worker", 1, "distributed.env_worker_cpus")
    cluster.wait_for_room(fake, {"CPU": 2.0}, "env worker", 2, "distributed.env_worker_cpus")  # one a node
    with pytest.raises(ConfigError):
        cluster.wait_for_room(fake, {"CPU": 1.5}, "env worker", 3, "distributed.env_worker_cpus")  # 0.5 left each


def test_room_falls_back_to_the_clusters_sum_where_ray_has_no_per_node_view(monkeypatch):
    """Through Ray Client (``ray://``) this process holds no GCS connection: Ray's per-node call
    raises RaySystemError ('Ray has not been started yet'); the sum is the check there."""
    from types import SimpleNamespace

    from ray.exceptions import RaySystemError

    def no_view():
        raise RaySystemError("Ray has not been started yet")

    fake = SimpleNamespace(available_resources=lambda: {"CPU": 4.0}, nodes=lambda: [],
                           _private=SimpleNamespace(state=SimpleNamespace(available_resources_per_node=no_view)))
    monkeypatch.setattr(cluster, "ROOM_WAIT_S", 0.0)
    cluster.wait_for_room(fake, {"CPU": 2.0}, "env worker", 2, "distributed.env_worker_cpus")


def test_a_new_env_pool_counts_room_per_node_before_it_keeps_an_idle_pool():
    """Half a CPU free on each of two nodes is no room for a worker of 1 CPU: counted as one
    free CPU, the idle pool was kept and the new pool's workers waited, then failed the run."""
    from types import SimpleNamespace

    from agentrl.distributed.env_workers import _room_for

    free = {"n1": {"CPU": 0.5}, "n2": {"CPU": 0.5}}
    fake = SimpleNamespace(available_resources=lambda: {"CPU": 1.0},
                           _private=SimpleNamespace(state=SimpleNamespace(available_resources_per_node=lambda: free)))
    dist = DistributedConfig(num_env_workers=1, env_worker_cpus=1.0)
    assert not _room_for(fake, dist, "agentrl/GuessNumber-v0", {}, [])
    idle = SimpleNamespace(options={"num_cpus": 1.0, "resources": {}}, workers=["w"])  # one worker of 1 CPU
    assert _room_for(fake, dist, "agentrl/GuessNumber-v0", {}, [], freed=[idle])  # its CPU, on one node
    dist2 = DistributedConfig(num_env_workers=2, env_worker_cpus=1.0)
    assert not _room_for(fake, dist2, "agentrl/GuessNumber-v0", {}, [], freed=[idle])
