"""examples/train_alfworld_gpu.yaml, the GPU recipe, dry-run on CPU: the same config with
only its size and device shrunk runs one training step through every code path it names
(rollouts on a Ray rollout worker, GiGPO, the KL to a reference, evaluation), and the
keys it adds for GPUs (a worker's GPUs, the vLLM engine's sizing) reach what they size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.credit_options import GiGPOOptions
from agentrl.errors import ConfigError
from agentrl.train.config import load_train_config

ray = pytest.importorskip("ray", reason="ray is not installed here: pip install 'agentrl[ray]' (make extras)")


RECIPE = Path(__file__).resolve().parents[2] / "examples" / "train_alfworld_gpu.yaml"
# What the dry run changes, and nothing else: the model, the device, the sizes. The vLLM
# engine is swapped for hf (vLLM's CUDA wheel is not on a CPU machine); it runs on the
# rollout worker as vLLM would.
SHRINK = ["policy.backend=hf", "policy.model=tiny-random", "policy.device=cpu",
          "distributed.rollout_worker_gpus=0", "distributed.rollout_worker_cpus=0.25",
          "distributed.env_worker_cpus=0.25", "sampling.max_new_tokens=8", "rollout.max_turns=3",
          "rollout.group_size=2", "train.tasks_per_step=2", "train.steps=1", "train.evaluation.episodes=2",
          "train.evaluation.every=1", "train.checkpointing.every=1", "train.checkpointing.export_hf=false", "train.output.plot=false",
          "train.output.tensorboard=false"]


def test_the_recipe_keeps_verl_agents_published_settings():
    cfg = load_train_config(RECIPE)
    t = cfg.train
    assert (t.tasks_per_step, cfg.rollout.group_size, t.steps, t.optimizer.lr) == (16, 8, 150, 1e-6)
    assert t.credit == GiGPOOptions(gamma=0.95, omega=1.0, scale="none")
    assert (t.loss.kl_coef, t.loss.kl_estimator) == (0.01, "k3")
    assert cfg.env.kwargs == {"max_steps": 50, "invalid_penalty": 0.1} and cfg.rollout.max_turns == 50
    assert (cfg.sampling.temperature, t.evaluation.temperature, cfg.sampling.max_new_tokens) == (1.0, 0.4, 512)
    assert cfg.policy.backend == "vllm" and cfg.policy.vllm.dtype == "bfloat16"
    assert cfg.policy.vllm.max_model_len >= cfg.rollout.max_context_tokens


def test_the_recipe_trains_one_step_on_cpu_with_the_tiny_model(cluster, tmp_path):
    from agentrl.train.trainer import train

    cfg = load_train_config(RECIPE, [*SHRINK, f"train.output.dir={tmp_path}"])
    result = train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert len(rl) == 1 and rl[0]["policy/version"] == 1
    assert rl[0]["train/episodes"] == 4  # 2 tasks x 2
    assert rl[0]["rollout_workers/deaths"] == 0  # sampled on the Ray rollout worker, which lived
    assert "loss/kl" in rl[0]  # the KL to the reference was computed
    assert any(k.startswith("adv/") for k in rl[0])
    assert set(result["phases"]) == {"start", "end"}  # held-out success before and after
    assert any(tmp_path.glob("checkpoints/*")), "checkpointing.every=1 wrote no checkpoint"


def test_a_rollout_worker_asking_for_a_gpu_the_cluster_lacks_is_refused_by_name(cluster, tmp_path):
    from agentrl.distributed import RayPolicy
    from agentrl.models import load_tokenizer

    cfg = load_train_config(RECIPE, [*SHRINK, "distributed.rollout_worker_gpus=1", f"train.output.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout worker needing .*'GPU': 1\.0"):
        RayPolicy(cfg.policy, cfg.distributed, load_tokenizer("tiny-random"))


def test_vllm_engine_shorter_than_an_episode_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"policy\.vllm\.max_model_len \(2048\) is below rollout\.max_context_tokens"):
        load_train_config(RECIPE, ["policy.vllm.max_model_len=2048"])
