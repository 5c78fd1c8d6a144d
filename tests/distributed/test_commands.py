"""``agentrl rollout``, ``eval`` and ``proxy serve`` honour the distributed section as ``train``
does: they generate on rollout workers when it asks for them, and refuse a cluster that does
not answer, naming the key, instead of running in-process without a word."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from agentrl.cli import _mount_plugins, app

ray = pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")

runner = CliRunner()
NOWHERE = ["--set", "distributed.ray=127.0.0.1:1", "--set", "distributed.num_rollout_workers=2"]
TINY = ["--backend", "hf", "--model", "tiny-random", "--set", "sampling.max_new_tokens=4",
        "--set", "rollout.max_turns=2"]
ON_WORKERS = ["--set", "distributed.num_rollout_workers=1", "--set", "distributed.rollout_worker_cpus=0.25"]


def _commands(tmp_path) -> dict[str, list[str]]:
    return {"rollout": ["rollout", "--episodes", "2", "--out", str(tmp_path / "r"), "--no-progress"],
            "eval": ["eval", "--env", "agentrl/GuessNumber-v0", "--episodes", "2", "--out", str(tmp_path / "e"),
                     "--no-progress"],
            "proxy serve": ["proxy", "serve", "--port", "8125"]}


@pytest.fixture
def no_serving(monkeypatch):
    """``proxy serve`` records the policy it would serve instead of serving it."""
    import agentrl.proxy.app as proxy_app

    served: list[object] = []
    monkeypatch.setattr(proxy_app, "serve", lambda policy, *a, **kw: served.append(policy))
    _mount_plugins()
    return served


@pytest.mark.parametrize("command", ["rollout", "eval", "proxy serve"])
def test_a_cluster_that_does_not_answer_is_refused_naming_the_key(command, tmp_path, monkeypatch, no_serving):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever another test left connected
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init({kw}) would retry for minutes"))
    res = runner.invoke(app, [*_commands(tmp_path)[command], "--backend", "mock", *NOWHERE])
    assert res.exit_code == 2, res.output
    assert "cannot reach the Ray cluster at 127.0.0.1:1 (distributed.ray=127.0.0.1:1)" in _flat(res.output)
    assert no_serving == []


@pytest.fixture
def made(monkeypatch):
    """Every ``RayPolicy`` the commands make."""
    from agentrl.distributed import RayPolicy

    policies: list[RayPolicy] = []
    init = RayPolicy.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        policies.append(self)

    monkeypatch.setattr(RayPolicy, "__init__", spy)
    return policies


def test_rollout_and_eval_generate_on_rollout_workers(cluster, tmp_path, made):
    """The summary carries the rollout workers' counters: the episodes were sampled there."""
    for command, folder in (("rollout", "r"), ("eval", "e")):
        res = runner.invoke(app, [*_commands(tmp_path)[command], *TINY, *ON_WORKERS])
        assert res.exit_code == 0, res.output
        assert "on 1 rollout workers (Ray, distributed.ray=auto)" in _flat(res.output)
        summary = json.loads((tmp_path / folder / "summary.json").read_text())
        assert summary["rollout_workers/deaths"] == 0 and summary["rollout_workers/lost"] == 0
    assert len(made) == 2 and all(_all_killed(p) for p in made)  # each command killed its workers


def test_proxy_serve_serves_the_rollout_workers_and_kills_them_after(cluster, tmp_path, no_serving, made):
    res = runner.invoke(app, [*_commands(tmp_path)["proxy serve"], *TINY, *ON_WORKERS])
    assert res.exit_code == 0, res.output
    assert no_serving == made and len(made) == 1 and _all_killed(made[0])


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def _all_killed(policy, wait_s: float = 60.0) -> bool:
    """Every worker of ``policy`` is dead (``ray.kill`` takes effect asynchronously)."""
    deadline = time.monotonic() + wait_s
    for w in policy.workers:
        while True:
            try:
                ray.get(w.info.remote(), timeout=wait_s)
            except ray.exceptions.RayActorError:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    return True
