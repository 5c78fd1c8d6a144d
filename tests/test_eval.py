"""``agentrl eval`` and ``agentrl.evaluation``: pass@k and the rows by hand, the whole-split
run on a scripted env, and CLI smoke runs with the tiny random model."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from agentrl.config import Config
from agentrl.env import TextEnv, register_env
from agentrl.eval_cli import register
from agentrl.evaluation import (
    EvaluationConfig,
    TaskResult,
    evaluate_held_out,
    evaluate_split,
    held_out_seeds,
    pass_at_k,
    report_rows,
)
from agentrl.policy.mock import MockPolicy

app = typer.Typer()


@app.callback()
def _main() -> None:
    """A host app for the eval command."""


register(app)
runner = CliRunner()


class SplitEnv(TextEnv):
    """Split "a": tasks 0-3; "b": tasks 0-1. Say the seed to win in one step; seed 2 cannot be
    won (it wants "never") and seed 3's step crashes. Families: even and odd seeds."""

    family_labels = {"odd": "Odd", "even": "Even"}
    max_steps = 1

    def __init__(self, split: str = "a"):
        super().__init__()
        self.split = split
        self.seed_ = 0

    @property
    def num_tasks(self) -> int:
        return {"a": 4, "b": 2}[self.split]

    def task_family(self, seed: int) -> str:
        return "even" if seed % 2 == 0 else "odd"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.seed_ = int(seed or 0)
        return f"Say {self.seed_}.", {"instruction": "say the number", "tools": []}

    def step(self, action: str):
        if self.seed_ == 3:
            raise RuntimeError("simulated engine crash")
        won = action.strip() == ("never" if self.seed_ == 2 else str(self.seed_))
        return "Done.", float(won), True, False, {}


register_env("agentrl/TestEvalSplit-v0", entry_point=SplitEnv)


def _say_the_number(prompt: str) -> str:
    return prompt.rsplit("Say ", 1)[1].split(".", 1)[0]


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(3, 3, 2) == 1.0 and pass_at_k(6, 0, 3) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_rows_weight_each_task_once_in_the_labels_order():
    results = [TaskResult(0, "b", 4, 1, 0.25), TaskResult(1, "a", 4, 4, 1.0),
               TaskResult(2, "b", 4, 0, 0.0, ["env.step raised"]), TaskResult(3, "c", 4, 2, 0.5)]
    rows = report_rows(results, k=2, labels={"b": "Bee", "a": "Ay"})
    assert [(r.family, r.label, r.tasks, r.episodes, r.errors) for r in rows] == [
        ("b", "Bee", 2, 8, 1), ("a", "Ay", 1, 4, 0), ("c", "c", 1, 4, 0), ("All", "All", 4, 16, 1)]
    b, a, c, total = rows
    assert b.success == pytest.approx((1 / 4 + 0) / 2) and b.pass_at_k == pytest.approx((0.5 + 0) / 2)
    assert c.pass_at_k == pytest.approx(1 - 1 / 6)  # n=4, c=2: 1 - C(2,2)/C(4,2)
    assert total.success == pytest.approx((0.25 + 1 + 0 + 0.5) / 4)
    assert total.pass_at_k == pytest.approx((0.5 + 1 + 0 + 5 / 6) / 4)
    assert total.score == pytest.approx(1.75 / 4)


def test_whole_split_by_family_with_failures_counted(tokenizer):
    cfg = Config()
    policy = MockPolicy(tokenizer, _say_the_number)
    report, trees = evaluate_split("agentrl/TestEvalSplit-v0", policy, cfg, split="a")
    assert [t.meta["seed"] for t in trees] == [0, 1, 2, 3] and report.tasks == 4
    rows = {r.label: r for r in report.rows}
    assert list(rows) == ["Odd", "Even", "All"]
    assert (rows["Even"].tasks, rows["Even"].success, rows["Even"].errors) == (2, 0.5, 0)  # 0 won, 2 not
    assert (rows["Odd"].tasks, rows["Odd"].success, rows["Odd"].errors) == (2, 0.5, 1)  # 1 won, 3 crashed
    assert rows["All"].success == 0.5 and rows["All"].score == 0.5
    assert report.failure_reasons == {"env.step raised RuntimeError": 1}
    assert report.settings["max_turns"] == 1  # the env's max_steps
    report_b, _ = evaluate_split("agentrl/TestEvalSplit-v0", policy, cfg, split="b", k=2, samples=3)
    assert report_b.tasks == 2 and all(r.episodes == 3 * r.tasks for r in report_b.rows)
    assert report_b.rows[-1].pass_at_k == 1.0 == report_b.rows[-1].success


def test_held_out_evaluation_plays_one_episode_a_seed_whatever_the_training_budget(tokenizer):
    """The trainer's evaluation: one episode on each held-out seed, with the eval env kwargs and
    temperature, even when training counts its budget in turns (that budget once cut the
    evaluation to no episode at all); a failed episode counts as not solved, as on a whole split
    (it was once left out, so a crashing env raised the trainer's rate above agentrl eval's)."""
    cfg = Config.model_validate({"env": {"id": "agentrl/TestEvalSplit-v0"},
                                 "rollout": {"group_size": 4, "budget_unit": "turns", "budget": 2}})
    ev = EvaluationConfig(episodes=3, seed_start=1, temperature=0.0, env_kwargs={"split": "b"})
    assert held_out_seeds(ev) == [1, 2, 3]
    assert held_out_seeds(EvaluationConfig(task_seeds=[5, 0], episodes=9)) == [5, 0]
    played: list[Any] = []

    def collect_fn(env_id, policy, run, seeds, on_episode_done=None):
        from agentrl.rollout import collect

        played.append((run.env.kwargs, run.sampling.temperature, seeds))
        return collect(env_id, policy, run, seeds, on_episode_done=on_episode_done)

    got = evaluate_held_out(MockPolicy(tokenizer, _say_the_number), cfg, ev, collect_fn=collect_fn)
    assert played == [({"split": "b"}, 0.0, [1, 2, 3])]
    # seed 1 won, seed 2 wants "never" (lost), seed 3 crashed: 1 of the 3 seeds solved
    assert (got["eval/success"], got["eval/reward"], got["eval/failed"]) == (1 / 3, 1 / 3, 1)
    assert got["eval/turns"] == 1.0 and set(got) == {"eval/success", "eval/reward", "eval/turns",
                                                      "eval/failed", "time/eval_s"}


def test_cli_eval_writes_rows_and_trees(tmp_path):
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "TestEvalSplit", "--split", "a,b", "--backend", "mock",
                              "--limit", "3", "--out", str(out), "--no-progress",
                              "--set", "policy.mock_responses=['0']"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    a, b = summary["reports"]
    assert (a["split"], a["tasks"], b["split"], b["tasks"]) == ("a", 3, "b", 2)
    assert a["temperature"] == 0.0 and a["rows"][-1]["success"] == pytest.approx(1 / 3)  # only seed 0 said "0"
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 5
    assert "Even" in res.output and "success %" in res.output



def test_cli_eval_reads_a_train_config_and_leaves_its_train_sections_alone(tmp_path):
    """One config file for every command: a train recipe's run sections (policy, sampling,
    env, rollout) load for eval; its train and sft sections are the trainer's."""
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"policy": {"backend": "mock", "mock_responses": ["0"]},
                                   "train": {"steps": 3, "optimizer": {"lr": 1e-4}}, "sft": {"episodes": 4}}))
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "TestEvalSplit", "--split", "a", "--config", str(cfg),
                              "--limit", "3", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    (a,) = json.loads((out / "summary.json").read_text())["reports"]
    assert a["tasks"] == 3 and a["rows"][-1]["success"] == pytest.approx(1 / 3)

def test_cli_eval_errors_say_what_to_do(tmp_path):
    res = runner.invoke(app, ["eval", "--env", "agentrl/GuessNumber-v0", "--split", "test", "--backend", "mock",
                              "--out", str(tmp_path)])
    assert res.exit_code == 2 and "takes no split" in res.output
    res = runner.invoke(app, ["eval", "--env", "TestEvalSplit", "--k", "3", "--samples", "2",
                              "--backend", "mock", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--samples >= --k" in res.output
    for bad in (["--limit", "0"], ["--temperature", "-1"]):  # were an IndexError and a ValidationError
        res = runner.invoke(app, ["eval", "--env", "TestEvalSplit", "--backend", "mock", "--out", str(tmp_path), *bad])
        assert res.exit_code == 2 and f"Invalid value for '{bad[0]}'" in res.output, res.output


def test_cli_eval_on_procedural_alfworld_with_tiny_model(tmp_path):
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "agentrl/ALFWorld-v0", "--split", "valid_unseen", "--episodes", "3",
                              "--model", "tiny-random", "--backend", "hf", "--out", str(out), "--no-progress",
                              "--set", "sampling.max_new_tokens=4", "--set", "rollout.max_turns=2"])
    assert res.exit_code == 0, res.output
    (report,) = json.loads((out / "summary.json").read_text())["reports"]
    families = [r["family"] for r in report["rows"]]
    assert families[-1] == "All" and len(families) >= 2  # per task_type from the steps' info
    assert report["rows"][-1]["tasks"] == 3 and report["settings"]["max_turns"] == 2


def test_cli_eval_on_real_format_alfworld_with_tiny_model(tmp_path):
    from agentrl.envs.alfworld.real_engine import available

    if not available():
        pytest.skip("alfworld is not installed (pip install 'agentrl[alfworld]')")
    from agentrl.envs.alfworld.real_data import export_games
    from agentrl.envs.alfworld.scene import generate_scene

    export_games([generate_scene(s, "valid_unseen") for s in (0, 1, 2)], tmp_path / "data")
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "agentrl/ALFWorldReal-v0", "--split", "valid_unseen",
                              "--model", "tiny-random", "--backend", "hf", "--out", str(out), "--no-progress",
                              "--set", f"env.kwargs.data_dir={tmp_path / 'data'}", "--set", "env.kwargs.oracle=null",
                              "--set", "sampling.max_new_tokens=4", "--set", "rollout.max_turns=2"])
    assert res.exit_code == 0, res.output
    (report,) = json.loads((out / "summary.json").read_text())["reports"]
    assert [r["label"] for r in report["rows"]] == ["Pick", "Clean", "Heat", "All"]  # the papers' order
    assert report["rows"][-1]["tasks"] == 3 and report["rows"][-1]["errors"] == 0


@pytest.mark.parametrize("train_section, sets, want", [
    ({"precision": "fp32"}, [], "fp32"),  # the run sampled in fp32: its evaluation does too
    (None, [], "bf16"),  # no training config: what this CPU multiplies natively (forced here)
    ({"precision": "fp32"}, ["--set", "train.precision=bf16"], "bf16"),
    ({"precision": "fp32"}, ["--set", "policy.precision=bf16"], "bf16"),
])
def test_cli_eval_samples_in_the_precision_its_training_config_trained_in(tmp_path, monkeypatch, train_section,
                                                                          sets, want):
    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"policy": {"backend": "hf", "model": "tiny-random"},
                                   **({"train": train_section} if train_section else {})}))
    out = tmp_path / "ev"
    res = runner.invoke(app, ["eval", "--env", "TestEvalSplit", "--split", "a", "--config", str(cfg),
                              "--limit", "1", "--out", str(out), "--no-progress", *sets])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "summary.json").read_text())["precision"] == want
    assert f"sampling in {want}" in res.output
