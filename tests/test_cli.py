"""Smoke tests of every CLI command, with tiny budgets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from agentrl.cli import app

runner = CliRunner()


def test_envs_list_shows_builtin_env():
    res = runner.invoke(app, ["envs", "list"])
    assert res.exit_code == 0
    assert "agentrl/GuessNumber-v0" in res.output.split()


def test_models_list_names_default_and_tiny():
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0
    assert "smollm2-135m" in res.output and "tiny-random" in res.output


def test_models_prepare_rejects_unpreparable():
    res = runner.invoke(app, ["models", "prepare", "tiny-random"])
    assert res.exit_code == 2 and "needs no preparation" in res.output
    res = runner.invoke(app, ["models", "prepare", "smolm2-135m"])  # a typo is unknown, not "needs none"
    assert res.exit_code == 2 and "unknown model 'smolm2-135m'" in res.output


def test_rollout_with_mock_policy_writes_trees_and_summary(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["rollout", "--backend", "mock", "--episodes", "3", "--out", str(out),
                              "--set", "policy.mock_responses=['16']", "--no-progress"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 3 and summary["env"] == "agentrl/GuessNumber-v0"
    assert 0.0 <= summary["success_rate"] <= 1.0
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert "success_rate" in res.output


def test_rollout_with_tiny_model_and_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: {model: tiny-random}\nsampling: {max_new_tokens: 4}\n"
                   f"rollout: {{episodes: 2, max_turns: 2, out_dir: {tmp_path / 'r'}}}\n")
    res = runner.invoke(app, ["rollout", "--config", str(cfg), "--no-progress"])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["action_tokens"] > 0 and summary["mean_turns"] <= 2


def test_bad_input_is_a_clear_error_with_exit_code_2(tmp_path):
    res = runner.invoke(app, ["rollout", "--env", "GuesNumber", "--backend", "mock"])
    assert res.exit_code == 2 and "Did you mean 'agentrl/GuessNumber-v0'" in res.output
    res = runner.invoke(app, ["rollout", "--model", "gpt-17", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown model 'gpt-17'" in res.output
    assert "smollm2-135m" in res.output
    res = runner.invoke(app, ["rollout", "--set", "sampling.temperature=-1"])
    assert res.exit_code == 2 and "sampling.temperature" in res.output


def test_rollout_with_an_allocator_then_tree_prints_the_branches(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, [
        "rollout", "--backend", "mock", "--episodes", "2", "--out", str(out), "--no-progress",
        "--allocator", "segment_tree", "--allocator-option", "depth=2", "--allocator-option", "width=2",
        "--concurrency", "4", "--set", "rollout.budget=8", "--set", "rollout.max_turns=4",
        "--set", "env.kwargs={high: 1000, max_turns: 4}", "--set", "policy.mock_responses=['1', '2']"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["allocator"] == "segment_tree" and summary["episodes"] == 8
    res = runner.invoke(app, ["tree", str(out), "--index", "1"])
    assert res.exit_code == 0, res.output
    assert "allocator=segment_tree" in res.output and "branch x2" in res.output
    assert "counters: generated_tokens=" in res.output
    res = runner.invoke(app, ["tree", str(out), "--index", "5"])
    assert res.exit_code == 2 and "holds 2 trees" in res.output


def _user_env_module(tmp_path, monkeypatch, name: str) -> str:
    """A module of the user's own that registers myorg/<name>-v0 (a GuessNumber under another id)."""
    (tmp_path / f"{name.lower()}_envs.py").write_text(
        "from agentrl.env import register_env\n"
        f"register_env('myorg/{name}-v0', entry_point='agentrl.envs.guess_number:GuessNumberEnv')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name.lower()}_envs"


def test_rollout_finds_an_env_registered_in_the_users_module(tmp_path, monkeypatch):
    module = _user_env_module(tmp_path, monkeypatch, "UnitConvertA")
    res = runner.invoke(app, ["rollout", "--env", f"{module}:myorg/UnitConvertA-v0", "--backend", "mock",
                              "--episodes", "1", "--out", str(tmp_path / "a"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["env"] == "myorg/UnitConvertA-v0"
    module = _user_env_module(tmp_path, monkeypatch, "UnitConvertB")
    res = runner.invoke(app, ["rollout", "--env", "myorg/UnitConvertB-v0", "--backend", "mock",
                              "--set", f"env.imports=[{module}]", "--episodes", "1",
                              "--out", str(tmp_path / "b"), "--no-progress"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(("body", "said"), [
    ("raise RuntimeError('no GPU here')\n", "raised RuntimeError while it was imported: "),
    ("def broken(:\n", "raised SyntaxError while it was imported: "),
])
def test_a_users_env_module_that_fails_to_import_is_an_error_naming_it(tmp_path, monkeypatch, body, said):
    """Only an ImportError was caught: any other error in the user's module was a traceback."""
    (tmp_path / "broken_user_envs.py").write_text("import os\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = runner.invoke(app, ["rollout", "--env", "myorg/Broken-v0", "--backend", "mock",
                              "--set", "env.imports=[broken_user_envs]", "--episodes", "1",
                              "--out", str(tmp_path / "out"), "--no-progress"])
    assert res.exit_code == 2, res.output
    said_all = res.output.replace("\n", "")  # the console wraps long lines
    assert f"env module 'broken_user_envs' {said}" in said_all and "broken_user_envs.py" in said_all


def test_unknown_env_error_says_how_to_make_an_env_visible():
    res = runner.invoke(app, ["rollout", "--env", "agentrl/UnitConvert-v0", "--backend", "mock"])
    assert res.exit_code == 2
    assert "env.imports" in res.output and "module:" in res.output


def test_process_defaults_keep_compiled_kernels_under_agentrl_cache_unless_the_user_chose(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    from agentrl.cli import process_defaults

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    process_defaults()
    # torch reads the variable where it compiles, so its kernels land there, not in /tmp
    assert inductor_cache_dir() == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    process_defaults()
    assert inductor_cache_dir() == str(tmp_path / "mine")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    # a cache folder that cannot be made (here a file is in the way): torch's default stays
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "a_file"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    process_defaults()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_agentrl_command_sets_its_defaults_before_torch_compiles(tmp_path):
    """``main`` calls ``process_defaults``, and importing the CLI loads no inductor, which would
    fix torch's /tmp default into the environment first."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["AGENTRL_CACHE"] = str(tmp_path / "cache")
    probe = ("import sys, agentrl.cli as c; print('torch._inductor' in sys.modules); "
             "sys.argv = ['agentrl', 'envs', 'list']; c.main()")
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == "False"
    assert (tmp_path / "cache" / "inductor").is_dir()


def test_commands_that_need_no_model_do_not_import_torch():
    """The CLI mounts train, proxy, eval and viewer commands by importing their packages, whose
    exports are lazy (``agentrl.lazy_exports``): ``agentrl envs list`` loads neither torch nor
    transformers, while the names those packages export still resolve."""
    probe = ("import sys, agentrl.cli as c; sys.argv = ['agentrl', 'envs', 'list']\n"
             "try:\n    c.main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
             "from agentrl.train import Trainer, train_on_samples\nfrom agentrl.policy import HFPolicy\n"
             "print(Trainer.__module__, train_on_samples.__module__, HFPolicy.__module__)")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "agentrl/ALFWorld-v0" in lines
    assert lines[-2] == "[]"
    assert lines[-1] == "agentrl.train.trainer agentrl.train.batch agentrl.policy.hf"


def test_lazy_exports_name_their_package_and_refuse_unknown_names():
    import agentrl.train as train_pkg
    from agentrl.lazy_exports import lazy_exports

    assert "Learner" in dir(train_pkg) and "Learner" in train_pkg.__all__
    assert train_pkg.trainer.Trainer is train_pkg.Trainer  # a submodule is an attribute, as it was eagerly
    with pytest.raises(AttributeError, match="'agentrl.train' has no attribute 'Lerner'"):
        train_pkg.Lerner  # noqa: B018
    with pytest.raises(ValueError, match="exported by two modules"):
        lazy_exports("pkg", {".a": ["x"], ".b": ["x"]})


@pytest.mark.parametrize("train_section, sets, want", [
    ({"precision": "fp32"}, [], "fp32"), (None, [], "bf16"),
    (None, ["--set", "rollout.deterministic=true"], "fp32"),  # the hf backend computes fp32 there
])
def test_rollout_samples_in_the_precision_its_training_config_trains_in(tmp_path, monkeypatch, train_section, sets,
                                                                        want):
    """One config for every command: rollouts of a training config compute what its update does."""
    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")  # this CPU multiplies bf16 natively, as far as auto knows
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"policy": {"backend": "hf", "model": "tiny-random"},
                                   "sampling": {"max_new_tokens": 2},
                                   **({"train": train_section} if train_section else {})}))
    res = runner.invoke(app, ["rollout", "--config", str(cfg), "--env", "agentrl/GuessNumber-v0",
                              "--episodes", "1", "--out", str(tmp_path / "r"), "--no-progress", *sets])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["precision"] == want
    assert f"sampling in {want}" in res.output


@pytest.mark.parametrize("train_section, want", [({"precision": "fp32"}, "fp32"), (None, "bf16")])
def test_proxy_samples_in_the_precision_its_training_config_trains_in(tmp_path, monkeypatch, train_section, want):
    """The proxy's sessions become training data: its sampler computes what that update does."""
    import gc

    import agentrl.proxy.app as proxy_app
    from agentrl.cli import _mount_plugins

    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    served = []
    monkeypatch.setattr(proxy_app, "serve", lambda policy, *a, **k: served.append(policy.precision))
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"policy": {"backend": "hf", "model": "tiny-random"},
                                   **({"train": train_section} if train_section else {})}))
    _mount_plugins()
    try:
        res = runner.invoke(app, ["proxy", "serve", "--config", str(cfg), "--port", "0"])
    finally:
        gc.unfreeze()
    assert res.exit_code == 0, res.output
    assert served == [want]


def test_a_config_given_as_a_fifo_is_read_once_and_its_train_section_still_counts(tmp_path, monkeypatch):
    """``--config <(...)`` or a named pipe: a second read of the file (for train.precision) would
    find nothing, or wait forever for a writer."""
    import threading

    monkeypatch.setenv("AGENTRL_CPU_BF16", "1")
    fifo = tmp_path / "train.yaml"
    os.mkfifo(fifo)
    text = yaml.safe_dump({"policy": {"backend": "hf", "model": "tiny-random"}, "sampling": {"max_new_tokens": 2},
                           "train": {"precision": "fp32"}})
    writer = threading.Thread(target=fifo.write_text, args=(text,), daemon=True)
    writer.start()
    res = runner.invoke(app, ["rollout", "--config", str(fifo), "--env", "agentrl/GuessNumber-v0",
                              "--episodes", "1", "--out", str(tmp_path / "r"), "--no-progress"])
    writer.join(timeout=5)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["precision"] == "fp32"


def test_version_names_agentrl_and_the_libraries_a_bug_report_needs():
    import platform
    from importlib.metadata import version

    import agentrl

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    line = res.output.strip()
    assert line.startswith(f"agentrl {agentrl.__version__} (python {platform.python_version()}, ")
    assert f"torch {version('torch')}" in line and f"transformers {version('transformers')}" in line
    assert agentrl.__version__ == version("agentrl")  # the package and its metadata agree
    assert runner.invoke(app, ["envs", "list"]).exit_code == 0  # commands still run after the callback


def test_eval_with_a_temperature_too_small_to_sample_at_names_the_key(tmp_path):
    """It was assigned after the config was checked: a pydantic ValidationError traceback."""
    from agentrl.cli import _mount_plugins

    _mount_plugins()  # eval is mounted as main() mounts it
    res = runner.invoke(app, ["eval", "--env", "agentrl/GuessNumber-v0", "--backend", "mock", "--episodes", "1",
                              "--temperature", "1e-6", "--out", str(tmp_path / "ev"), "--no-progress"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "sampling.temperature: use 0 for greedy decoding, or at least 1e-05" in " ".join(res.output.split())
