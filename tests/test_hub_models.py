"""A Hugging Face Hub id (``org/name``) as ``policy.model``: read from the Hub cache, and a
clear error naming the id when the Hub cannot give it. Offline here, so the cache is
written by hand in the Hub's layout (``models--org--name/{refs/main, snapshots/<rev>/}``)
and the loads run in a subprocess with ``HF_HUB_OFFLINE=1`` (read when the Hub library is
imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from agentrl.models import is_hub_id, load_model


def test_hub_ids_are_told_from_names_and_folders(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct")
    assert not is_hub_id("smollm2-135m") and not is_hub_id("a/b/c") and not is_hub_id("/abs/path")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "m").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not is_hub_id("org/m")  # a local folder of that name wins
    finally:
        os.chdir(cwd)


def test_a_cached_hub_model_loads_and_a_missing_one_names_itself(tmp_path):
    model, tok = load_model("tiny-random")
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--someorg--tiny" / "snapshots" / rev
    model.save_pretrained(str(snap))
    tok.save_pretrained(str(snap))
    (tmp_path / "hub" / "models--someorg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--tiny" / "refs" / "main").write_text(rev)
    script = textwrap.dedent("""
        import torch
        from agentrl.errors import PolicyError
        from agentrl.models import load_model
        from agentrl.policy.vllm import _model_dir
        model, tok = load_model("someorg/tiny")
        print("layers", model.config.num_hidden_layers, "vocab", tok.vocab_size)
        print("folder", _model_dir("someorg/tiny").name)
        try:
            load_model("someorg/absent")
        except PolicyError as e:
            print("error", e)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert f"layers 2 vocab {tok.vocab_size}" in lines
    assert f"folder {rev}" in lines  # vLLM is given the snapshot folder
    err = next(line for line in lines if line.startswith("error"))
    assert "'someorg/absent'" in err and "Hub could not give it" in err
