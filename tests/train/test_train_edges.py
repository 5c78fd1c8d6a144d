"""Edges of the trainer core found by a hostile review: each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.errors import ConfigError
from agentrl.train.trainer import Trainer
from tests.train.test_trainer import toy_config

_QUIET = ["train.evaluation.episodes=0", "train.output.plot=false"]


def test_resume_with_fewer_trainable_parameters_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    """A checkpoint of a full fine-tune resumed as top_k: its weights fit the model (every name is
    there), but its optimizer state holds a moment for every parameter; torch's bare ValueError
    ('a parameter group that doesn't match the size') named no key. Now a ConfigError names
    train.trainable and what to do, as a change that leaves weights out already did."""
    torch.set_num_threads(1)
    full = Trainer(toy_config(tmp_path, *_QUIET), progress=False)
    try:
        full.save()
    finally:
        full.close()
    top = Trainer(toy_config(tmp_path, *_QUIET, "train.trainable=top_k", "train.top_k_layers=1"), progress=False)
    try:
        with pytest.raises(ConfigError, match=r"train\.trainable: the checkpoint trained 'full', this run 'top_k'"):
            top.resume()
    finally:
        top.close()


def _tensorboard_series(folder: Path, key: str) -> list[tuple[int, float]]:
    """What TensorBoard shows of ``key``: every event file of ``folder``, purges applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), purge_orphaned_data=True)
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(key)]


@pytest.mark.parametrize(("resume_step", "kept"), [(1, [(1, 1.0)]), (-1, [])])
def test_tensorboard_drops_the_steps_a_restarted_run_redoes(tmp_path: Path, resume_step: int,
                                                             kept: list[tuple[int, float]]) -> None:
    """metrics.jsonl drops the rows after the checkpoint a run resumes from (all of them for a
    run started over: one killed before its first checkpoint, run again), but TensorBoard's
    events were left in place: it showed the abandoned run's steps beside the new ones, and two
    values at each step the new run redid. Now the writer purges them as the file does."""
    from agentrl.train.metrics import MetricsLogger

    first = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        first.log(step, {"loss/pg": float(step)})
    first.close()
    again = MetricsLogger(tmp_path, tensorboard=True, resume_step=resume_step)
    again.log(2, {"loss/pg": 20.0})
    again.close()
    assert _tensorboard_series(tmp_path / "tensorboard", "loss/pg") == [*kept, (2, 20.0)]


def test_a_full_disk_still_prunes_old_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint is removed by renaming it hidden first. The hidden name was a new folder
    (mkdtemp), and a full ext4 disk refuses a new folder (ENOSPC; measured on an 8 MB loop
    disk filled up: mkdir failed, rename worked): pruning raised, and the old checkpoints whose
    space it was meant to free stayed. Now the rename goes to a hidden name beside it."""
    import errno
    import tempfile

    from agentrl.train import checkpoint as ck

    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, model, keep=None)

    def full(*_: object, **__: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)
    ck.prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003"]


def test_sft_whose_expert_episodes_the_context_budget_cut_says_so(tokenizer) -> None:
    """An expert episode that outgrows rollout.max_context_tokens ends unfinished and is left out
    as a loss. With every episode cut, SFT said 'the expert won none of the tasks' (it wins
    them all with room: bisection over 32 numbers in 4 guesses), sending the user to debug
    the env's expert instead of the budget. Now the error names the budget and how many it cut."""
    from types import SimpleNamespace

    from rich.console import Console

    from agentrl.train.config import load_train_config
    from agentrl.train.sft import sft_phase

    cfg = load_train_config(None, ["env.id=agentrl/GuessNumber-v0", "env.kwargs={high: 32, max_turns: 8}",
                                   "rollout.max_turns=8", "rollout.max_context_tokens=100", "sft.task_seeds=[0, 5]"])
    learner = SimpleNamespace(cfg=cfg, policy=SimpleNamespace(tokenizer=tokenizer), console=Console())
    with pytest.raises(ConfigError, match=r"2 of the 2 tasks .*rollout\.max_context_tokens=100"):
        sft_phase(learner)  # type: ignore[arg-type]


def test_a_resume_trains_with_the_config_s_weight_decay_and_betas(tmp_path: Path) -> None:
    """torch's ``Optimizer.load_state_dict`` brings back the saved hyperparameters with the
    moments, and the resume put back only the config's lr: a run continued with another
    train.optimizer.weight_decay or betas was told 'this run's config differs: ... 0.0 -> 0.1',
    then trained with the checkpoint's values, and its next checkpoint recorded the new ones."""
    torch.set_num_threads(1)
    first = Trainer(toy_config(tmp_path, *_QUIET), progress=False)
    try:
        first.save()
    finally:
        first.close()
    changed = ["train.optimizer.weight_decay=0.1", "train.optimizer.betas=[0.8, 0.95]"]
    again = Trainer(toy_config(tmp_path, *_QUIET, *changed), progress=False)
    try:
        assert again.resume()
        groups = again.learner.optimizer.param_groups
        assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [(0.1, (0.8, 0.95))] * len(groups)
    finally:
        again.close()


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """Same parameter names, other shapes (a resume with policy.model moved to a bigger model of
    the same family): ``load_trainable`` checked names only, and ``copy_`` raised torch's bare
    'The size of tensor a (3) must match the size of tensor b (2)', which the resume does not
    turn into a config error. Now it is the ValueError the resume names the changed key for."""
    from agentrl.train import checkpoint as ck
    from agentrl.train.trainer import _unfit_key

    small, big = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match=r"shape.*weight: \(2, 2\) in the checkpoint, \(3, 2\) in the model"):
        ck.load_trainable(big, ck.trainable_state(small))
    changed = {"policy.model": ("tiny", "big"), "train.steps": (1, 2)}
    assert _unfit_key(changed, tmp_path) == "policy.model: the checkpoint trained 'tiny', this run 'big'"


def test_a_save_goes_on_where_the_filesystem_cannot_flush_a_folder(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Some filesystems refuse fsync on a folder (EINVAL: FUSE mounts such as gcsfuse, CIFS;
    PostgreSQL's fsync_fname ignores it for that reason). The save then raised after its
    checkpoint was in place, and the run died at its first checkpoint. A folder's flush is now
    skipped where the filesystem refuses it; a file's still raises."""
    import errno
    import os
    import stat

    from agentrl.train import checkpoint as ck

    real = os.fsync

    def no_folder_fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(os, "fsync", no_folder_fsync)
    path = ck.save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2))
    assert ck.load_checkpoint(path).step == 1


@pytest.mark.parametrize("advantage", [-1.0, 0.0])
def test_m2po_masks_a_token_whose_sampler_logprob_is_minus_inf(advantage: float) -> None:
    """M2PO masks only trust-region tokens (A > 0 and r > 1, A < 0 and r < 1). A sampler's -inf
    logprob makes r infinite; with A < 0 (or A = 0) that token is outside the region, so it kept
    its term -A * r: +inf (or 0 * inf = NaN), in the loss and in every gradient, and the
    optimizer step wrote NaN into the weights. Such a token now leaves the policy-gradient
    term, as M2PO's own mask drops the largest ratios; its gradient is 0, the others' as before."""
    from agentrl.train.loss import PolicyLossConfig, policy_loss

    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, float("-inf"), -0.5]])
    loss, stats = policy_loss(lp, torch.tensor([[1.0, advantage, 0.5]]), torch.ones(1, 3),
                              PolicyLossConfig(m2po_tau=0.04), behaviour_logprobs=behaviour)
    loss.backward()
    # r = 1 on the finite tokens: loss = -(1 + 0.5) / 3, d/dlp_t = -A_t r_t / 3
    assert float(loss.detach()) == pytest.approx(-0.5)
    assert lp.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -0.5 / 3])
    assert stats["m2po/masked_frac"] == pytest.approx(1 / 3)


def test_overwrite_keeps_the_old_run_when_the_new_one_is_refused(tmp_path: Path) -> None:
    """--overwrite (make run passes it) removed the old run's checkpoints, TensorBoard events
    and trees first, then built the trainer; a config the trainer refuses (an env keyword the
    env does not take, a teacher that does not load) then left neither run. The old one is now
    removed only once the new one is built."""
    from agentrl.train import checkpoint as ck
    from agentrl.train.trainer import train

    ck.save_checkpoint(tmp_path, 3, torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="env.kwargs"):
        train(toy_config(tmp_path, *_QUIET, "env.kwargs={no_such_keyword: 1}"), overwrite=True, progress=False)
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["step-000003"]


def test_a_resume_with_another_lora_rank_names_the_key(tmp_path: Path) -> None:
    """LoRA adapters of another rank have the same names and other shapes: copy_ raised torch's
    bare size mismatch out of the resume. Now the ConfigError names train.lora.r."""
    torch.set_num_threads(1)
    lora = [*_QUIET, "train.trainable=lora"]
    first = Trainer(toy_config(tmp_path, *lora, "train.lora.r=4"), progress=False)
    try:
        first.save()
    finally:
        first.close()
    again = Trainer(toy_config(tmp_path, *lora, "train.lora.r=2"), progress=False)
    try:
        with pytest.raises(ConfigError, match=r"train\.lora\.r: the checkpoint trained 4, this run 2; .*another shape"):
            again.resume()
    finally:
        again.close()


def test_a_minibatch_whose_gradient_is_not_finite_steps_no_weight_and_is_counted(tiny_model):
    """A NaN or inf gradient (a ratio overflowing past 88 nats, say) went into AdamW, which wrote NaN
    into every weight and its moments for good. That minibatch's step is skipped and counted; the
    next one steps as usual."""
    import copy

    from agentrl.train.batch import Sample, train_on_samples
    from agentrl.train.loss import PolicyLossConfig, StepLoss

    model = copy.deepcopy(tiny_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []
    param = next(p for p in model.parameters() if p.requires_grad)
    param.register_hook(lambda g: g * float("nan") if not calls.append(1) and len(calls) == 1 else g)
    n = 12
    samples = [Sample(list(range(5 + k, 5 + k + n)), [0] * 4 + [1] * (n - 4), [-1.0] * n,
                      [0.0] * 4 + [1.0 - 2 * k] * (n - 4), [0] * n) for k in range(2)]
    st = train_on_samples(model, opt, None, samples, StepLoss(PolicyLossConfig(), version=0),
                          fields=("advantages", "behaviour", "versions"), epochs=1, minibatch_size=1,
                          max_tokens=2048, max_grad_norm=1.0, per_token=True, pad_id=0, temperature=1.0,
                          orders=[[0, 1]])
    assert len(calls) == 2
    assert st["train/nonfinite_grad_steps"] == 1 and st["train/optimizer_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(v).all() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # the second step ran


def test_read_metrics_skips_a_line_nested_past_the_parser_or_with_a_huge_int(tmp_path):
    """Such a line raised RecursionError or ValueError (not JSONDecodeError) out of read_metrics,
    so a resume or `agentrl report` of that run stopped; it is skipped with a warning, as a
    torn line is."""
    from agentrl.train.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + "[" * 100_000 + "\n" + '{"x": ' + "1" * 5000 + "}\n" + '{"step": 2}\n')
    with pytest.warns(RuntimeWarning, match="metrics.jsonl:2: skipped"):
        rows = read_metrics(path)
    assert rows == [{"step": 1}, {"step": 2}]


def test_a_trainer_that_fails_to_build_closes_the_policy_it_made(tmp_path, monkeypatch):
    """A failure after the policy was made (a rollout source or a teacher that will not load) left
    it running: for rollout workers or a vLLM engine, their memory until garbage collection. The
    trainer now closes what it made before the error goes up."""
    import agentrl.policy.for_run as for_run
    from tests.train.test_trainer import SHORT

    made = []
    real = for_run.policy_for_run
    monkeypatch.setattr(for_run, "policy_for_run", lambda *a, **k: made.append(real(*a, **k)) or made[-1])

    def rollouts(policy, cfg):
        raise RuntimeError("no harness here")

    with pytest.raises(RuntimeError, match="no harness here"):
        Trainer(toy_config(tmp_path, *SHORT), progress=False, rollouts=rollouts)
    assert len(made) == 1 and made[0].batcher.closed


def test_overwrite_refuses_a_run_that_starts_from_a_model_in_the_folder_it_clears(tmp_path):
    """``--overwrite`` with policy.model naming the same run folder loaded the old export, then
    removed it under the run (since 5f05ac8 removes after the trainer is built): the saved config
    named a folder gone. It is refused before anything loads or is removed."""
    from agentrl.errors import ConfigError
    from agentrl.train.trainer import train

    out = tmp_path / "run"
    export = out / "checkpoints" / "step-000001" / "hf"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    cfg = toy_config(out, f"policy.model={out}")
    with pytest.raises(ConfigError, match=r"policy\.model=.* is inside train\.output\.dir"):
        train(cfg, overwrite=True, progress=False)
    assert (export / "config.json").exists()
