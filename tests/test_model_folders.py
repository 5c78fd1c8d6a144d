"""A run's output folder and its checkpoints name models (``agentrl.models.model_folder``):
``agentrl eval --model runs/x`` evaluates the run's newest export, and says which."""

from __future__ import annotations

import json

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
    with pytest.raises(PolicyError, match=r"no transformers model \(no config\.json\): pass a model's folder"):
        model_folder(str(tmp_path))
    with pytest.raises(PolicyError, match=r"no transformers model"):
        model_folder(str(root / "checkpoints" / "step-000001"))  # no export of its own
    bare = tmp_path / "bare"
    (bare / "checkpoints" / "step-000004").mkdir(parents=True)
    with pytest.raises(PolicyError, match=r"newest checkpoint, step-000004, has no transformers export"):
        load_model(str(bare))


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
