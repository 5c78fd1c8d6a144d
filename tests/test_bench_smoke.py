"""The core benches run end to end in --quick mode and check what their rows claim."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(script: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def test_rollout_overhead_checks_that_every_path_samples_the_same_tokens(tmp_path):
    result = _run("rollout_overhead.py", tmp_path / "r.json")
    assert result["rows"] > 0 and result["action_tokens"] > 0
    assert result["rows_differing_policy"] == 0
    assert 0 <= result["rows_differing_hf_generate"] <= result["rows"]


def test_multiturn_cost_reuse_prefills_less_and_samples_the_same(tmp_path):
    result = _run("multiturn_cost.py", tmp_path / "m.json")
    reuse, full = result["rows"]
    assert (reuse["config"], full["config"]) == ("hf+reuse", "hf")
    assert full["prefilled_tokens"] == full["sum_of_contexts"] and full["reused_tokens"] == 0
    # Below the sum of the deltas when rows of a batch share an opening (prefilled once).
    assert reuse["prefilled_tokens"] < full["prefilled_tokens"]
    assert reuse["prefilled_tokens"] + reuse["reused_tokens"] == reuse["sum_of_contexts"]
    assert reuse["cache"]["hits"] > 0
    assert result["first_turn_where_samples_differ"] is None
    # The same samples need the same passes (counted from the tokens, not the run).
    assert full["speculation"] == reuse["speculation"]


def test_proxy_overhead_measures_each_protocol_on_sessions_that_stay_one_path(tmp_path):
    result = _run("proxy_overhead.py", tmp_path / "p.json")
    assert set(result["protocols"]) == {"chat", "responses", "messages"}
    for name, row in result["protocols"].items():
        assert row["sessions_checked_one_path"] > 0, name  # the bench raises if a session branched
        assert row["min_reused_tokens_from_turn_2"] > 0, name


def test_row_layout_times_every_layout_on_one_gradient(tmp_path):
    result = _run("row_layout.py", tmp_path / "l.json")
    assert set(result["cases"]) == {"make_run_sft", "uniform_64"}
    for name, case in result["cases"].items():
        assert set(case["seconds"]) == {"packed", "padded", "singles", "picked"}, name
        assert all(v > 0 for v in case["seconds"].values()), name
        # every layout trains on the same gradient as the packed one (float rounding apart)
        assert max(case["grad_max_rel_diff_vs_packed"].values()) < 1e-4, name
        assert sum(case["rows_picked"].values()) >= 1, name


def test_prompt_lookup_steps_by_hand():
    sys.path.insert(0, str(BENCH))
    from multiturn_cost import prompt_lookup_steps

    # The context ends "1 2", which occurred before followed by "3 4 1 2": drafts [3, 4, 1, 2].
    # Sampled 3, 4, 9: 3 and 4 are kept, 9 is sampled where the draft said 1. One pass, not three.
    assert prompt_lookup_steps([1, 2, 3, 4, 1, 2], [3, 4, 9]) == 1
    # Nothing to look up (no earlier occurrence): one token a pass.
    assert prompt_lookup_steps([5, 6, 7], [8, 9]) == 2
    # At most k drafts a pass. k=2: drafts [3, 4] both kept, 5 sampled; then "3 4 5" drafts
    # [6, 1]: 6 kept, 7 sampled; then nothing to look up for the 8. Three passes, not six.
    ctx, action = [1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 6, 7, 8]
    assert prompt_lookup_steps(ctx, action, k=2) == 3
    # k=4: drafts [3, 4, 5, 6] all kept and 7 sampled in one pass; the 8 in a second.
    assert prompt_lookup_steps(ctx, action, k=4) == 2


def test_learning_aggregates_seeds_into_a_mean_curve_with_its_standard_error():
    sys.path.insert(0, str(BENCH))
    from learning import aggregate

    def run(seed, succ, env_steps):
        curve = [{"step": 0, "env_steps": 0, "episodes": 0, "success": 0.5},
                 {"step": 2, "env_steps": env_steps, "episodes": 48, "success": succ}]
        return {"seed": seed, "curve": curve, "final_success": succ, "rollout_success_mean": 0.1,
                "env_steps": env_steps, "generated_tokens": 10, "episodes": 48, "rollout_s": 1.0,
                "train_s": 2.0, "wall_s": 3.0,
                "anchor": {"later_steps": env_steps - 8, "later_steps_in_groups_of_2plus": 20}}

    r = aggregate([run(0, 0.5, 100), run(1, 1.0, 120)])
    # anchor counts add over seeds: 40 of the 92 + 112 later steps
    assert r["anchor"] == {"later_steps": 204, "later_steps_in_groups_of_2plus": 40,
                           "later_frac_in_groups_of_2plus": round(40 / 204, 4)}
    # mean 0.75; sample std 0.3536, over sqrt(2): 0.25
    assert r["final_success"] == 0.75 and r["final_success_se"] == 0.25
    assert r["curve"][1] == {"step": 2, "env_steps": 110.0, "episodes": 48, "success": 0.75, "success_se": 0.25}
    assert r["curve"][0]["success_se"] == 0.0 and r["env_steps"] == 110.0 and r["wall_s"] == 6.0
    assert r["seeds"] == [0, 1] and aggregate([run(0, 0.5, 100)])["final_success_se"] == 0.0
    no_final = run(2, 0.5, 100)
    no_final["final_success"] = None  # a run without a final evaluation
    assert aggregate([run(0, 0.5, 100), no_final])["final_success"] is None
    other = run(3, 0.5, 100)
    other["curve"][1]["step"] = 4
    with pytest.raises(ValueError, match="evaluated at steps"):
        aggregate([run(0, 0.5, 100), other])


def test_tree_savings_segment_tree_shares_its_first_segments_at_equal_leaves(tmp_path):
    result = _run("tree_savings.py", tmp_path / "t.json")
    rows = {r["allocator"]: r for r in result["rows"]}
    assert list(rows) == ["independent", "segment_tree", "entropy_branch"]
    for r in rows.values():  # 2 tasks x 8 leaves each, every episode to max_turns=8
        assert r["leaves"] == 16 and r["open_leaves"] == 0 and r["failed_episodes"] == 0
        assert r["episode_turns"] == {"8": 16} and r["path_turns"] == 16 * 8
    ind, seg = rows["independent"], rows["segment_tree"]
    assert ind["leaves_per_task"] == [8, 8] and ind["branch_nodes"] == 0
    assert ind["turns_sampled"] == 128 and ind["generated_tokens"] == ind["path_action_tokens"]
    # Depth 4, width 2, 8 leaves a task, 2-turn segments: 1 + 2 + 4 segments of 2
    # turns, then 8 runs of the last 2 turns: 30 turns a task instead of 64.
    assert seg["turns_sampled"] == 2 * 30 and seg["env_steps"] == 60
    assert seg["branch_nodes"] == 2 * (1 + 2 + 4) and seg["shared_tokens"] > 0
    assert seg["generated_tokens"] < seg["path_action_tokens"]
    assert result["expected_turn_saving_pct_if_all_episodes_run_max_turns"] == round(100 * (1 - 30 / 64), 1)
    assert seg["fewer_generated_pct"] == round(100 * (1 - seg["generated_tokens"] / ind["generated_tokens"]), 1)
    assert result["target_met"] == (seg["fewer_generated_pct"] >= 40.0)


def test_learning_runs_every_method_on_the_same_budget_from_one_warm_start(tmp_path):
    out = tmp_path / "l.json"
    subprocess.run([sys.executable, str(BENCH / "learning.py"), "--quick", "--out", str(out),
                    "--work-dir", str(tmp_path / "runs"), "--set", "train.loss.agg=seq-mean-token-mean"],
                   check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["methods"] == ["grpo", "gigpo", "tree", "grpo_opd", "grpo_opsd"]
    assert result["config"]["train"]["loss"]["agg"] == "seq-mean-token-mean"  # --set reached every run
    runs = result["results"]
    for r in runs.values():
        # Step 0 is the warm start's own evaluation, then one evaluation after each of 2 steps.
        assert [p["step"] for p in r["curve"]] == [0, 1, 2]
        assert r["curve"][0]["success"] == result["warm_start"]["success"]
        assert r["episodes"] == 2 * 3 * 8  # equal leaves: steps x tasks x group size
        assert 0 < r["env_steps"] and r["curve"][-1]["env_steps"] == r["env_steps"]
    # Trees share their first turns, so the same leaves play fewer env steps (GuessNumber
    # episodes of a random model run all 4 turns).
    assert runs["tree"]["env_steps"] < runs["grpo"]["env_steps"]
    assert "teacher" in result and len(list((tmp_path / "runs").glob("teacher-*/checkpoints/*/hf"))) == 1
    # GiGPO's runs count the steps that fell into anchor-state groups; the others log none.
    anchor = runs["gigpo"]["anchor"]
    assert anchor["steps"] == runs["gigpo"]["env_steps"] and anchor["steps_in_groups_of_2plus"] >= 2 * 3 * 8
    assert runs["grpo"]["anchor"] == {}


def _learning(out, work, *extra: str, wait: bool = True):
    cmd = [sys.executable, str(BENCH / "learning.py"), "--quick", "--resume", "--out", str(out),
           "--work-dir", str(work), *extra]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_learning_resume_adds_runs_to_the_json_without_repeating_any_and_refuses_another_config(tmp_path):
    """``--resume``: a second bench reuses the exported warm start and the recorded runs, adds its own,
    and one with other settings stops before any SFT instead of mixing its runs into the same JSON."""
    out, work = tmp_path / "l.json", tmp_path / "runs"
    first = _learning(out, work, "--methods", "grpo", "--seeds", "0")
    assert first.returncode == 0, first.stderr[-3000:]
    one = json.loads(out.read_text())
    (weights,) = work.glob("warm_start-*/checkpoints/*/hf/model.safetensors")
    made = weights.stat().st_mtime_ns
    second = _learning(out, work, "--methods", "grpo,gigpo", "--seeds", "0,1")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "grpo seed 0: recorded in" in second.stdout
    two = json.loads(out.read_text())
    assert weights.stat().st_mtime_ns == made  # the SFT was not run again
    assert two["warm_start"]["weights_sha256"] == one["warm_start"]["weights_sha256"]
    assert {m: r["seeds"] for m, r in two["results"].items()} == {"grpo": [0, 1], "gigpo": [0, 1]}
    assert two["results"]["grpo"]["runs"][0] == one["results"]["grpo"]["runs"][0]  # kept as it was
    assert two["seeds"] == [0, 1] and two["methods"] == ["grpo", "gigpo"]
    for r in two["results"].values():
        assert r["episodes"] == 2 * 3 * 8 and [p["step"] for p in r["curve"]] == [0, 1, 2]

    for extra, what in ((["--set", "train.optimizer.lr=1e-3"], "config"),
                        (["--sft-epochs", "3"], "warm_start_from"),
                        (["--opd-weight", "0.5"], "opd_weight")):
        other = _learning(out, work, "--methods", "tree", "--seeds", "0", *extra)
        assert other.returncode != 0 and f"holds runs made with another {what}" in other.stderr, other.stderr[-2000:]
        assert json.loads(out.read_text()) == two  # nothing written
        assert len([d for d in work.glob("warm_start-*") if d.is_dir()]) == 1  # refused before any SFT ran
    assert weights.stat().st_mtime_ns == made


def test_learning_benches_side_by_side_share_one_sft_and_run_each_method_and_seed_once(tmp_path):
    out, work = tmp_path / "l.json", tmp_path / "runs"
    procs = [_learning(out, work, "--methods", "grpo,tree", "--seeds", "0,1", wait=False) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outputs]
    result = json.loads(out.read_text())
    assert {m: r["seeds"] for m, r in result["results"].items()} == {"grpo": [0, 1], "tree": [0, 1]}
    ran = [line.split(":")[0] for o, _ in outputs for line in o.splitlines()
           if re.match(r"(grpo|tree) seed \d: held-out success", line)]
    assert sorted(ran) == ["grpo seed 0", "grpo seed 1", "tree seed 0", "tree seed 1"]  # each once, all told
    assert len(list(work.glob("warm_start-*/checkpoints/*/hf/model.safetensors"))) == 1  # one SFT


def test_learning_rerun_in_deterministic_mode_repeats_its_curves_and_losses(tmp_path):
    """``--deterministic``: the same command twice gives the same curves, rollouts and losses, bit for bit."""
    results = []
    for k in range(2):
        out = tmp_path / f"l{k}.json"
        subprocess.run([sys.executable, str(BENCH / "learning.py"), "--quick", "--deterministic", "--methods",
                        "tree", "--seeds", "0,1", "--out", str(out), "--work-dir", str(tmp_path / f"runs{k}")],
                       check=True, capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        runs = json.loads(out.read_text())["results"]["tree"]["runs"]
        losses = [[r.get("loss/total") for r in map(json.loads, (tmp_path / f"runs{k}" / "tree" / f"seed{s}" /
                                                                  "metrics.jsonl").read_text().splitlines())
                   if r.get("phase") == "rl"] for s in (0, 1)]
        results.append(([(r["curve"], r["env_steps"], r["generated_tokens"]) for r in runs], losses))
    assert results[0] == results[1]
    per_seed, losses = results[0]
    # not vacuous: the two sampling seeds played different rollouts (a random model; its losses may be
    # None where a step had no signal, and those repeat too)
    assert per_seed[0][1:] != per_seed[1][1:] and len(losses[0]) == len(losses[1]) == 2


def test_scale_runs_every_episode_in_process_and_on_1_and_2_env_workers(tmp_path):
    try:
        import ray  # noqa: F401
    except ImportError as e:
        pytest.skip(f"ray does not import here ({e}): pip install 'agentrl[ray]'")
    result = _run("scale.py", tmp_path / "s.json")
    rows = result["rows"]
    assert [(r["workload"], r["setup"], r["env_workers"]) for r in rows] == [
        (w, s, n) for w in ("bashfix", "micro") for s, n in (("thread", None), ("ray-1", 1), ("ray-2", 2))]
    episodes, bash_calls = result["args"]["episodes"], result["args"]["bash_calls"]
    for r in rows:  # every row ran its whole batch, with no failed episode
        assert r["episodes"] == episodes and r["failed_episodes"] == 0
        assert r["wall_s"] > 0 and r["episodes_per_s"] > 0
    for r in rows[:3]:  # bashfix: the test runs, then the answer
        assert r["env_steps"] == episodes * (bash_calls + 1)
    assert len({r["env_steps"] for r in rows[3:]}) == 1  # the micro rows play the same episodes
    assert set(result["round_trip"]) == {"local_step_us_p50", "ray_step_us_p50", "ray_round_trip_us"}
    assert isinstance(result["ray_overhead_per_env_step_us"], float)
    assert result["bashfix_speedup_1_to_2_workers"] > 0
    machine = result["machine"]
    assert machine["cpus"] == os.cpu_count() and len(machine["load_avg_at_end"]) == 3
    assert "cap scaling" in result["note"]


def test_async_train_reports_each_steps_time_success_and_staleness(tmp_path):
    result = _run("async_train.py", tmp_path / "a.json")
    runs = {r["run"]: r for r in result["runs"]}
    assert list(runs) == ["sync", "async_k1", "async_k2"]
    steps = result["args"]["steps"]
    for r in runs.values():
        assert [s["step"] for s in r["steps"]] == list(range(1, steps + 1))
        for s in r["steps"]:
            assert s["wall_s"] > 0 and s["generated_tokens"] > 0 and 0 <= s["rollout_success"] <= 1
        assert r["step_s_mean"] > 0 and r["generated_tokens_per_s"] > 0
    assert not any(k.startswith("async/") for s in runs["sync"]["steps"] for k in s)
    for name, k in (("async_k1", 1), ("async_k2", 2)):  # the staleness the trainer logged stays within k
        for s in runs[name]["steps"]:
            assert 0 <= s["async/staleness_mean"] <= s["async/staleness_max"] <= k
            assert s["async/dropped_batches"] == 0
    assert runs["sync"]["speedup_vs_sync"] == 1.0


def test_inprocess_runs_leave_no_model_alive(tmp_path):
    result = _run("inprocess_runs.py", tmp_path / "i.json")
    assert len(result["rows"]) == 2 and all(r["models_alive"] == 0 for r in result["rows"])
    assert all(r["rss_mb"] > 0 for r in result["rows"])


def test_gpu_check_runs_every_part_of_the_gpu_recipe_check_on_cpu(tmp_path):
    """bench/gpu_check.sh --quick: hf decoding and one training step of
    examples/train_alfworld_gpu.yaml (shrunk, on CPU) through the same script a GPU runs."""
    out = tmp_path / "gpu_check.json"
    subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--quick", "--out", str(out)], check=True,
                   capture_output=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    r = json.loads(out.read_text())
    hf = next(row for row in r["decode"] if row["backend"] == "hf")
    assert hf["tokens"] > 0 and hf["tok_per_s"] > 0
    assert "skipped" in next(row for row in r["decode"] if row["backend"] == "vllm")
    assert "error" not in r["train"], r["train"]
    assert r["train"]["train/tokens"] > 0 and r["train"]["time/train_s"] > 0


def test_alfworld_full_trains_then_reports_each_split_per_family(tmp_path):
    """The commands a user runs (agentrl train, then agentrl eval on each split), gathered."""
    entry = _run("alfworld_full.py", tmp_path / "a.json")["recipe"]
    assert entry["train"]["sft_s"] > 0 and entry["model"].endswith("/hf")
    for split in ("valid_seen", "valid_unseen"):
        assert entry["splits"][split]["model"] == entry["model"]  # the trained model, not the config's
        rows = entry["splits"][split]["rows"]
        assert rows[-1]["family"] == "All" and rows[-1]["tasks"] == 2
        assert sum(r["tasks"] for r in rows[:-1]) == 2 and 0.0 <= rows[-1]["success"] <= 1.0


def test_heap_reuse_runs_each_cell_with_the_heap_setting_it_names(tmp_path):
    out = tmp_path / "heap_reuse.json"
    _run("heap_reuse.py", out)
    data = json.loads(out.read_text())
    cells = {(r["precision"], r["keep"]): r for r in data["raw"]}
    assert set(cells) == {("fp32", False), ("fp32", True)}
    for (_, keep), r in cells.items():
        assert r["keep_freed_memory"] is keep  # the child's mallopt took effect exactly where asked
        assert r["tokens_per_epoch"] > 0 and len(r["tokens_per_s"]) == 2 and min(r["tokens_per_s"]) > 0
    summary = data["summary"]["fp32_keep_1"]
    assert summary["gain"] == pytest.approx(summary["tokens_per_s_median"]
                                            / data["summary"]["fp32_keep_0"]["tokens_per_s_median"])
