"""A run's output folder and its checkpoints name models (``agentrl.models.model_folder``):
``agentrl eval --model runs/x`` evaluates the run's newest export, and says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from agentrl.errors import PolicyError
from agentrl.eval_cli import register
from agentrl.models import exact_model, load_model, load_tokenizer, model_folder

app = typer.Typer()


@app.callback()
def _main() -> None:
    """A host app for the eval command."""


register(app)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run's folder as training leaves it: step 1 without an export, step 2 with one whose
    weights differ from the base model's, and a killed save's temp folder."""
    root = tmp_path_factory.mktemp("run")
    model, tok = load_model("tiny-random")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    for step, export in ((1, False), (2, True)):
        ck = root / "checkpoints" / f"step-{step:06d}"
        ck.mkdir(parents=True)
        (ck / "state.json").write_text("{}")
        if export:
            model.save_pretrained(ck / "hf")
            tok.save_pretrained(ck / "hf")
    (root / "checkpoints" / ".tmp-step-000003").mkdir()
    return root, model


def test_a_run_folder_means_its_newest_export_and_a_checkpoint_its_own(run):
    root, trained = run
    newest = root / "checkpoints" / "step-000002" / "hf"
    assert model_folder(str(root)) == newest
    assert model_folder(str(root / "checkpoints" / "step-000002")) == newest
    assert model_folder(str(newest)) == newest
    assert exact_model(str(root)) == str(newest) and exact_model("tiny-random") == "tiny-random"
    loaded, tok = load_model(str(root))
    torch.testing.assert_close(loaded.lm_head.weight, trained.lm_head.weight)
    assert load_tokenizer(str(root)).vocab_size == tok.vocab_size


def test_folders_without_a_model_say_what_to_pass(run, tmp_path):
    root, _ = run
    with pytest.raises(PolicyError, match=r"holds no model \(no config\.json, no JSON file at all\)"):
        model_folder(str(tmp_path))
    with pytest.raises(PolicyError, match=r"this checkpoint has no transformers export .*; step-000002 of its run"):
        model_folder(str(root / "checkpoints" / "step-000001"))
    bare = tmp_path / "bare"
    (bare / "checkpoints" / "step-000004").mkdir(parents=True)
    with pytest.raises(PolicyError, match=r"newest checkpoint, step-000004, has no transformers export.*"
                                          r"none of its checkpoints has one yet"):
        load_model(str(bare))
    (bare / "checkpoints" / "step-000003" / "hf").mkdir(parents=True)
    (bare / "checkpoints" / "step-000003" / "hf" / "config.json").write_text("{}")
    with pytest.raises(PolicyError, match=r"step-000004, has no transformers export.*; step-000003 has one"):
        model_folder(str(bare))


def test_the_newest_checkpoint_is_the_highest_step_and_nothing_else_counts(tmp_path):
    """Steps by number (as the trainer orders them), not by name; temp folders of a save in
    progress and stray files are no checkpoints; the checkpoints folder itself works too."""
    ck = tmp_path / "run" / "checkpoints"
    for name in ("step-999999", "step-1000000", ".tmp-step-2000000-ab12", "step-3000000-old"):
        (ck / name / "hf").mkdir(parents=True)
        (ck / name / "hf" / "config.json").write_text("{}")
    (ck / "step-notes.txt").write_text("a note")
    assert model_folder(str(tmp_path / "run")) == ck / "step-1000000" / "hf"
    assert model_folder(str(ck)) == ck / "step-1000000" / "hf"


def test_folders_transformers_loads_without_a_config_pass_through(tmp_path):
    """A PEFT adapter or a tokenizer alone has no config.json; transformers decides, as before."""
    adapter, tokenizer = tmp_path / "adapter", tmp_path / "tokenizer"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    load_tokenizer("tiny-random").save_pretrained(tokenizer)
    assert model_folder(str(adapter)) == adapter and exact_model(str(adapter)) == str(adapter)
    assert load_tokenizer(str(tokenizer)).vocab_size == load_tokenizer("tiny-random").vocab_size


def test_eval_on_a_run_folder_records_the_checkpoint_it_loaded(run, tmp_path):
    root, _ = run
    out = tmp_path / "ev"
    res = CliRunner().invoke(app, ["eval", "--env", "agentrl/GuessNumber-v0", "--model", str(root),
                                   "--episodes", "1", "--out", str(out), "--no-progress",
                                   "--set", "sampling.max_new_tokens=2"])
    assert res.exit_code == 0, res.output
    want = str(root / "checkpoints" / "step-000002" / "hf")
    assert json.loads((out / "summary.json").read_text())["model"] == want
    assert "step-000002" in " ".join(res.output.split())


@pytest.mark.parametrize("recorded, sets, want, followed", [
    ({"config": {"train": {"precision": "fp32"}}}, [], "fp32", True),  # the run trained (and evaluated) in fp32
    ({"config": {"train": {"precision": "fp32"}}}, ["--set", "policy.precision=bf16"], "bf16", False),
    ({"config": {"train": {"precision": "fp16"}}}, [], "bf16", False),  # not a precision: the device decides
    ({}, [], "bf16", False),  # a state that does not say (the fixture's): the device decides
])
def test_eval_of_a_run_folder_samples_in_the_precision_the_run_trained_in(run, tmp_path, monkeypatch, recorded,
                                                                          sets, want, followed):
    """Without a training config, ``agentrl eval --model runs/x`` took the device's precision:
    a run trained with train.precision fp32 was scored in bf16, off its own evaluations."""
    import shutil

    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")  # this CPU's own answer would be bf16
    root = tmp_path / "run"
    shutil.copytree(run[0], root)
    (root / "checkpoints" / "step-000002" / "state.json").write_text(json.dumps(recorded))
    out = tmp_path / "ev"
    res = CliRunner().invoke(app, ["eval", "--env", "agentrl/GuessNumber-v0", "--model", str(root), "--backend", "hf",
                                   "--episodes", "1", "--out", str(out), "--no-progress",
                                   "--set", "sampling.max_new_tokens=2", *sets])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "summary.json").read_text())["precision"] == want
    said = " ".join(res.output.split())
    assert f"sampling in {want}" in said
    assert ("(its run's train.precision)" in said) == followed


def test_training_from_a_run_folder_pins_its_export_and_a_resume_says_when_it_moved(run, tmp_path):
    """The learner, the sampler and the saved config take the export the folder meant when the
    run started; resumed after the source exported a newer one, the run says which it loaded."""
    import io
    import shutil

    from rich.console import Console

    from agentrl.train.trainer import train
    from tests.train.test_trainer import toy_config

    root, _ = run
    source = tmp_path / "source"
    shutil.copytree(root, source)
    out = tmp_path / "rl"
    base = ["train.evaluation.episodes=0", "train.checkpointing.export_hf=false", f"policy.model={source}"]
    summary = train(toy_config(out, "train.steps=1", *base), progress=False)
    state = json.loads((Path(summary["checkpoint"]) / "state.json").read_text())
    first = str(source / "checkpoints" / "step-000002" / "hf")
    assert state["config"]["policy"]["model"] == first
    shutil.copytree(source / "checkpoints" / "step-000002", source / "checkpoints" / "step-000007")
    buf = io.StringIO()
    train(toy_config(out, "train.steps=2", *base), resume=True, progress=False, console=Console(file=buf, width=400))
    said = buf.getvalue()
    assert f"resume: the checkpoint's run started from policy.model={first}" in said
    assert str(source / "checkpoints" / "step-000007" / "hf") in said
