"""Ctrl-C in `agentrl rollout` and `agentrl eval`: the tasks that had finished are written,
marked as an interrupted run, and the exit code is 130. Before, an interrupted run wrote nothing.

The commands run in a child process that gets a real SIGINT while some episodes are stuck in
an env step, as a user's Ctrl-C would find them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

# Seeds below 3 end on their first step; larger ones block in it (as a slow env would), after
# leaving a marker, so the test knows when to press Ctrl-C.
ENV_MODULE = '''
import os, pathlib, time
from agentrl.env import TextEnv, register_env

MARKS = pathlib.Path(os.environ["MARKS"])

class Stuck(TextEnv):
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.seed_ = seed
        return "say anything", {"instruction": "say anything"}

    def step(self, action):
        if self.seed_ >= 3:
            (MARKS / f"stuck-{self.seed_}").touch()
            for _ in range(600):  # 60 s: far longer than the test waits
                time.sleep(0.1)
        (MARKS / f"done-{self.seed_}").touch()
        return "ok", 1.0, True, False, {"instruction": "say anything"}

register_env("test/Stuck-v0", entry_point=Stuck)
'''


def _interrupt(tmp_path, args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``agentrl ARGS`` until seeds 0-2 are done and 3-5 are stuck, then send SIGINT."""
    (tmp_path / "stuck_envs.py").write_text(ENV_MODULE)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks), "COLUMNS": "200", "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "agentrl", *args, "--backend", "mock", "--no-progress",
                             "--set", "env.imports=[stuck_envs]", "--set", "rollout.concurrency=8"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # a job a shell started with & ignores SIGINT, and its children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    want = {f"done-{s}" for s in range(3)} | {f"stuck-{s}" for s in range(3, 6)}
    deadline = time.monotonic() + 120
    while not want <= {p.name for p in marks.iterdir()}:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never got stuck as planned: {proc.communicate()[0]}")
        time.sleep(0.1)
    time.sleep(1.0)  # the finished episodes' last bookkeeping after their step
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"Ctrl-C did not end the run within 60 s: {proc.communicate()[0]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out), time.monotonic() - t0


def _seeds(path) -> list[int]:
    return [json.loads(line)["meta"]["seed"] for line in path.read_text().splitlines()]


def test_ctrl_c_in_rollout_writes_the_finished_tasks_and_says_the_run_was_interrupted(tmp_path):
    out = tmp_path / "run"
    res, took = _interrupt(tmp_path, ["rollout", "--env", "test/Stuck-v0", "--episodes", "6", "--out", str(out)])
    assert res.returncode == 130, res.stdout
    assert "interrupted: wrote the 3 of 6 task(s) whose episodes had all ended" in res.stdout
    assert sorted(_seeds(out / "trajectories.jsonl")) == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["interrupted"], summary["tasks_finished"], summary["tasks_planned"]) == (True, 3, 6)
    assert (summary["episodes"], summary["success_rate"]) == (3, 1.0)
    assert took < 30, f"the stuck env steps held the exit for {took:.0f} s"


def test_ctrl_c_in_eval_reports_the_finished_tasks_as_interrupted(tmp_path):
    out = tmp_path / "eval"
    res, _ = _interrupt(tmp_path, ["eval", "--env", "test/Stuck-v0", "--episodes", "6", "--out", str(out)])
    assert res.returncode == 130, res.stdout
    assert "interrupted: 3 of 6 tasks" in res.stdout
    assert sorted(_seeds(out / "trajectories.jsonl")) == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    [report] = summary["reports"]
    assert summary["interrupted"] and report["interrupted"] and report["tasks"] == 6
    assert sorted(r["seed"] for r in report["results"]) == [0, 1, 2]
    [row] = [r for r in report["rows"] if r["family"] == "All"]
    assert (row["tasks"], row["success"]) == (3, 1.0)
