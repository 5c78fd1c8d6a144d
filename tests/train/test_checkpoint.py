"""Checkpoints: atomic writes, rotation, RNG and state round trips, SIGKILL then --resume, HF export."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.models import load_model
from agentrl.train import checkpoint as ck
from agentrl.train.trainer import train
from tests.train.test_trainer import TOY, toy_config

ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    return load_model("tiny-random")[0]


def test_save_then_load_round_trips_weights_optimizer_and_state(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    path = ck.save_checkpoint(tmp_path, 7, model, opt, state={"version": 3})
    assert path.name == "step-000007" and ck.latest_checkpoint(tmp_path) == path
    got = ck.load_checkpoint(path)
    assert got.step == 7 and got.state["version"] == 3
    fresh = _model()
    ck.load_trainable(fresh, got.trainable)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    opt2.load_state_dict(got.optimizer)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


class _RunsCode:
    """A pickle that runs code when loaded: what a checkpoint from an untrusted source can hold."""

    def __reduce__(self):
        return (os.system, ("touch ran-code-from-checkpoint",))


@pytest.mark.parametrize("part", ["optimizer.pt", "rng.pt"])
def test_loading_a_checkpoint_never_runs_code_from_its_pickles(tmp_path, monkeypatch, part):
    monkeypatch.chdir(tmp_path)
    path = ck.save_checkpoint(tmp_path, 1, _model(), torch.optim.AdamW(_model().parameters()))
    ck.load_checkpoint(path)  # numpy's random state, the optimizer's and scheduler's dicts load
    torch.save({"optimizer": _RunsCode(), "scheduler": None, "python": _RunsCode()}, path / part)
    with pytest.raises(Exception, match="(?i)weights only"):
        ck.load_checkpoint(path)
    assert not (tmp_path / "ran-code-from-checkpoint").exists()


def test_a_save_flushes_every_file_to_disk_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(Path, "rename", lambda self, to: (events.append(("rename", str(self))),
                                                          real_rename(self, to))[1])
    ck.save_checkpoint(tmp_path, 4, _model(), export_hf=True)
    rename = next(i for i, (kind, p) in enumerate(events) if kind == "rename" and ".tmp-" in p)
    tmp = events[rename][1]
    flushed = {Path(p).relative_to(tmp).as_posix() for kind, p in events[:rename]
               if kind == "fsync" and p.startswith(tmp)}
    written = {q.relative_to(tmp_path / "checkpoints" / "step-000004").as_posix()
               for q in (tmp_path / "checkpoints" / "step-000004").rglob("*")}
    assert written <= flushed and {"trainable.safetensors", "hf/config.json"} <= written
    assert ("fsync", str(tmp_path / "checkpoints")) in events[rename:]  # the rename itself


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    model = _model()
    first = ck.save_checkpoint(tmp_path, 1, model)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_export_hf", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, 2, model, export_hf=True)
    assert ck.checkpoint_dirs(tmp_path) == [first]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    # A temp folder left by a SIGKILL (no cleanup ran) is ignored, then swept by the next save.
    (tmp_path / "checkpoints" / ".tmp-step-000003-x").mkdir()
    assert ck.latest_checkpoint(tmp_path) == first
    monkeypatch.undo()
    ck.save_checkpoint(tmp_path, 3, model)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


_RESAVE_THEN_DIE = """
import os, sys, pathlib, torch
from agentrl.models import load_model
from agentrl.train import checkpoint as ck
model = load_model("tiny-random")[0]
ck.save_checkpoint(sys.argv[1], 3, model, keep=1)
rename = pathlib.Path.rename
def die(self, target):  # SIGKILL as the new folder is moved into place
    if self.name.startswith(".tmp-") and pathlib.Path(target).name.startswith("step-"):
        os._exit(9)
    return rename(self, target)
pathlib.Path.rename = die
with torch.no_grad():
    next(model.parameters()).add_(1.0)
ck.save_checkpoint(sys.argv[1], 3, model, keep=1)
"""


def test_a_resave_of_the_same_step_killed_midway_leaves_the_old_checkpoint_whole(tmp_path):
    """Saving step N again (a resumed finished run saves its end again) removed the old step-N
    before the new one was moved into place: a SIGKILL in between left no step-N, and with
    ``keep: 1`` no checkpoint at all, so ``--resume`` started the run over. Now the old one is
    set aside until the new one is in place, and put back when the save died in between."""
    done = subprocess.run([sys.executable, "-c", _RESAVE_THEN_DIE, str(tmp_path)], cwd=ROOT, timeout=120)
    assert done.returncode == 9
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000003"
    got = ck.load_checkpoint(ck.latest_checkpoint(tmp_path))
    first = next(iter(_model().state_dict().values()))
    assert torch.equal(next(iter(got.trainable.values())), first)  # the old weights, whole
    ck.save_checkpoint(tmp_path, 4, _model(), keep=1)  # and the next save leaves nothing hidden behind
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000004"]


def test_a_resave_of_the_same_step_interrupted_midway_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    model = _model()
    path = ck.save_checkpoint(tmp_path, 3, model, state={"which": "old"}, keep=1)
    rename = Path.rename

    def interrupt(self, target):
        if self.name.startswith(".tmp-") and Path(target).name.startswith("step-"):
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", interrupt)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 3, model, state={"which": "new"}, keep=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [path.name]
    assert ck.load_checkpoint(path).state["which"] == "old"


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model = _model()
    for step in (1, 2, 3, 10):
        ck.save_checkpoint(tmp_path, step, model, keep=2)
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["step-000003", "step-000010"]


def test_rng_states_restore_every_generator():
    state = ck.capture_rng()
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    ck.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_loading_into_a_model_with_other_trainable_params_fails_clearly(tmp_path):
    model = _model()
    model.requires_grad_(False)
    model.model.norm.requires_grad_(True)
    got = ck.load_checkpoint(ck.save_checkpoint(tmp_path, 1, model))
    assert list(got.trainable) == ["model.norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        ck.load_trainable(_model(), got.trainable)  # all of it trains there


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc={proc.returncode}) before {path.name}: "
                                 f"{proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"{path.name} did not appear in {timeout} s")
        time.sleep(0.1)


def _by_step(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r.get("phase") == "rl"}


RUN = ["train.steps=4", "train.checkpointing.every=1", "train.evaluation.episodes=4", "train.optimizer.lr=1e-3"]


def test_sigkill_mid_run_then_resume_repeats_the_uninterrupted_steps(tmp_path):
    """A real ``agentrl train`` process is SIGKILLed in step 3; ``--resume`` continues from the
    step-2 checkpoint, and steps 3 and 4 see the same data and loss as a run never interrupted."""
    torch.set_num_threads(1)
    straight = tmp_path / "straight"
    train(toy_config(straight, *RUN, "train.checkpointing.export_hf=true"), progress=False)

    killed = tmp_path / "killed"
    mark = tmp_path / "stalled"
    cmd = [sys.executable, "-c", "import tests.train.test_trainer; from agentrl.train.cli import app; app()",
           "train", "--no-progress"]
    for item in TOY + RUN + [f"train.output.dir={killed}"]:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    stall = {"AGENTRL_TEST_STALL_SEED": "8", "AGENTRL_TEST_STALL_MARK": str(mark)}  # step 3's first task
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **stall}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        _wait_for(mark, proc, timeout=240)
        # A second run into the live run's folder (make run passes --overwrite) is refused, and
        # deletes nothing of it: it had removed the live run's checkpoints.
        for flag in ("--overwrite", "--resume"):
            second = subprocess.run(cmd + [flag], cwd=ROOT, env=env, capture_output=True, timeout=300)
            said = (second.stdout + second.stderr).decode()
            assert second.returncode != 0 and "in use by another run" in said, said[-2000:]
            assert f"pid {proc.pid} on " in " ".join(said.split()), said[-2000:]
            assert ck.latest_checkpoint(killed).name == "step-000002"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ck.latest_checkpoint(killed).name == "step-000002"
    assert sorted(_by_step(killed)) == [1, 2]

    # The killed run's lock went with its process: resuming needs no clean-up.
    done = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"resumed from step 2" in done.stdout
    a, b = _by_step(straight), _by_step(killed)
    assert sorted(b) == [1, 2, 3, 4]  # the file never holds a step twice
    for step in (3, 4):
        assert b[step]["data/first_task_seed"] == a[step]["data/first_task_seed"] == 4 * (step - 1)
        assert b[step]["rollout/reward"] == a[step]["rollout/reward"]
        assert b[step]["train/episodes"] == a[step]["train/episodes"]
        assert b[step]["loss/total"] == pytest.approx(a[step]["loss/total"], abs=1e-5)
        assert b[step]["loss/total"] != 0.0
        assert b[step]["policy/version"] == step


def test_exported_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train(toy_config(out, "train.steps=1", "train.evaluation.episodes=0", "train.checkpointing.export_hf=true"),
          progress=False)
    last = ck.latest_checkpoint(out)
    hf = AutoModelForCausalLM.from_pretrained(str(last / "hf"))
    trained = _model()
    ck.load_trainable(trained, ck.load_checkpoint(last).trainable)
    base = _model()
    ids = torch.tensor([[1, 400, 500, 600]])
    with torch.no_grad():
        got, want, before = (m(input_ids=ids).logits for m in (hf, trained, base))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, before)  # the export holds the trained weights
    assert (last / "hf" / "tokenizer.json").exists()



def test_sigkill_mid_branched_run_then_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path):
    """The same for branched rollouts in deterministic mode (segment_tree on ALFWorld-v0, see
    tests/rollout/test_determinism.py): the resumed steps' rollouts (down to the behaviour
    logprobs, which the trainer's mismatch statistics read), losses and final weights are those
    of the run never interrupted, to the bit, although the killed run's prefix cache and
    micro-batches died with it."""
    from agentrl.train.config import load_train_config
    from tests.rollout.test_determinism import BRANCHED  # registers agentrl/TestStallingALFWorld-v0

    torch.set_num_threads(1)
    run = BRANCHED + ["env.id=agentrl/TestStallingALFWorld-v0", "train.steps=4", "train.checkpointing.every=1"]
    straight = tmp_path / "straight"
    train(load_train_config(None, run + [f"train.output.dir={straight}"]), progress=False)

    killed = tmp_path / "killed"
    mark = tmp_path / "stalled"
    cmd = [sys.executable, "-c", "import tests.rollout.test_determinism; from agentrl.train.cli import app; app()",
           "train", "--no-progress"]
    for item in run + [f"train.output.dir={killed}"]:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    stall = {"AGENTRL_TEST_STALL_SEED": "4", "AGENTRL_TEST_STALL_MARK": str(mark)}  # step 3's first task
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **stall}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        _wait_for(mark, proc, timeout=240)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ck.latest_checkpoint(killed).name == "step-000002"

    done = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"resumed from step 2" in done.stdout
    a, b = _by_step(straight), _by_step(killed)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step]["data/first_task_seed"] == a[step]["data/first_task_seed"] == 2 * (step - 1)
        assert b[step]["rollout/env_steps"] == a[step]["rollout/env_steps"]
        assert b[step]["rollout/generated_tokens"] == a[step]["rollout/generated_tokens"]
        assert b[step]["loss/total"] == a[step]["loss/total"] != 0.0
        assert b[step]["mismatch/max_abs_dlogprob"] == a[step]["mismatch/max_abs_dlogprob"]
        assert b[step]["mismatch/kl"] == a[step]["mismatch/kl"]
        assert b[step]["policy/version"] == step
    want = ck.load_checkpoint(ck.latest_checkpoint(straight)).trainable
    got = ck.load_checkpoint(ck.latest_checkpoint(killed)).trainable
    assert want.keys() == got.keys()
    for name, w in want.items():
        assert torch.equal(w, got[name]), name


def test_a_resumed_run_trains_at_the_config_s_learning_rate_not_the_checkpoint_s(tmp_path):
    """A run continued with a new ``train.optimizer.lr`` uses it (the config decides), and says so;
    it drops the saved trees of the steps after the one it resumed from."""
    from rich.console import Console

    torch.set_num_threads(1)
    out = tmp_path / "run"
    base = ["train.evaluation.episodes=0", "train.output.plot=false", "train.checkpointing.every=1"]
    train(toy_config(out, "train.steps=1", "train.optimizer.lr=1e-2", *base), progress=False)
    # What a run killed before its step-2 checkpoint (or resumed before with more steps) left: the
    # resumed run drops those trees as it drops their metrics rows (the viewer showed them beside its own).
    for k in (2, 3):
        (out / "trees" / f"step-00000{k}.jsonl").write_text("{}\n")
    console = Console(record=True, width=200)
    train(toy_config(out, "train.steps=2", "train.optimizer.lr=1e-3", *base), resume=True, progress=False,
          console=console)
    assert [p.name for p in sorted((out / "trees").glob("*"))] == ["step-000001.jsonl", "step-000002.jsonl"]
    assert (out / "trees" / "step-000002.jsonl").read_text() != "{}\n"  # the resumed run's own step 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["train/lr"] for r in rows if r.get("phase") == "rl"}
    assert lrs == {1: pytest.approx(1e-2), 2: pytest.approx(1e-3)}
    assert "continues at train.optimizer.lr=0.001" in console.export_text()

