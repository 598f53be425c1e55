"""Checkpoints, exact resume and fault tolerance with real processes (issue 4; PITFALLS #6 #10-#13 #15 #25).

Reference runs and interrupted runs train the same toy trajectory; an interrupted run uses
data.sleep_s so that a signal or a SIGKILL lands mid-training.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import read_metrics, run_cli, subprocess_env
from helpers import (COMMON, DROPOUT, FP16, SLOW, STEPS, bitwise_equal, finish, logged_step, preempt, sample_stream, start,
                     wait_until, weights, worker_pid)
from launcher.preempt import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.slow


def test_sigkill_of_one_rank_restarts_the_group_and_loses_nothing(tmp_path: Path, reference) -> None:
    """Issue 4 test 1: SIGKILL rank 1 after a checkpoint -> torchrun restarts the group -> exact resume."""
    run_dir = tmp_path / "killed"
    proc = start(run_dir, *SLOW, "launcher.max_restarts=1")
    wait_until(lambda: (run_dir / "checkpoints" / "40" / "COMPLETE").exists())
    time.sleep(random.uniform(0.0, 0.3))
    os.kill(worker_pid(proc.pid, rank=1), signal.SIGKILL)
    finish(proc, 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from"] >= 40
    assert bitwise_equal(weights(run_dir), weights(reference["fp32"]))
    # every step's samples exactly once, as in the uninterrupted run: none skipped or repeated
    assert sample_stream(run_dir) == sample_stream(reference["fp32"])


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM], ids=["USR2", "TERM"])
def test_preemption_checkpoints_then_resume_auto_is_exact(tmp_path: Path, reference, sig) -> None:
    """Issue 4 test 2: the signal to the launcher reaches every rank; one checkpoint; requeue code;
    a second launch with resume=auto continues with nothing redone; bitwise equal final weights. SIGINT (Ctrl-C:
    without it among the preemption signals, each rank raised KeyboardInterrupt and saved nothing) takes the same
    path, and tests/test_same_command.py resumes after it, bitwise."""
    run_dir = tmp_path / "preempted"
    step = preempt(run_dir, sig)
    assert max(m["step"] for m in read_metrics(run_dir)) == step
    out = finish(start(run_dir, *SLOW), 0)
    assert f"resumed from step {step}" in out
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == list(range(1, STEPS + 1))  # the in-flight step was finished, none redone
    assert bitwise_equal(weights(run_dir), weights(reference["fp32"]))
    assert sample_stream(run_dir) == sample_stream(reference["fp32"])
    assert not (run_dir / "preempted.json").exists()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path, reference) -> None:
    """PITFALLS #11: USR2 to rank 1's process alone (a notice that reached one node, or one process) -> the
    flag travels in the step's all-reduce, both ranks stop after the same step with one complete checkpoint
    and no half-written one, the launcher exits with the requeue code, and the resume is exact, its samples
    too (stopped in epoch 1, not 0: PITFALLS #15)."""
    run_dir = tmp_path / "one_rank"
    proc = start(run_dir, *SLOW)
    # in the second epoch (64 steps each): the resumed sample stream is that epoch's permutation (PITFALLS #15)
    wait_until(lambda: logged_step(run_dir) >= random.randint(70, 90))
    os.kill(worker_pid(proc.pid, rank=1), signal.SIGUSR2)
    finish(proc, REQUEUE_EXIT_CODE)
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert max(m["step"] for m in read_metrics(run_dir)) == step
    assert (run_dir / "checkpoints" / str(step) / "COMPLETE").exists()
    assert all((d / "COMPLETE").exists() for d in (run_dir / "checkpoints").iterdir())  # none half-written
    out = finish(start(run_dir, *SLOW), 0)
    assert f"resumed from step {step}" in out
    assert bitwise_equal(weights(run_dir), weights(reference["fp32"]))
    assert sample_stream(run_dir) == sample_stream(reference["fp32"])


def test_dropout_continues_each_ranks_random_stream_across_a_preemption(tmp_path: Path, reference) -> None:
    """Randomness in the forward (dropout, as in +exp=bert): the resumed run draws what the uninterrupted
    one drew, rank by rank, so losses and final weights are bitwise the same."""
    run_dir = tmp_path / "dropout"
    preempt(run_dir, signal.SIGUSR2, *DROPOUT)
    finish(start(run_dir, *SLOW, *DROPOUT), 0)
    assert [m["loss"] for m in read_metrics(run_dir) if "loss" in m] == \
           [m["loss"] for m in read_metrics(reference["dropout"]) if "loss" in m]
    assert bitwise_equal(weights(run_dir), weights(reference["dropout"]))
    assert not bitwise_equal(weights(run_dir), weights(reference["fp32"]))  # dropout did something


def test_fp16_scaler_state_survives_a_resume(tmp_path: Path, reference) -> None:
    """Issue 4 test 3 / PITFALLS #6: loss scale, growth tracker and the next steps bitwise equal."""
    run_dir = tmp_path / "fp16"
    step = preempt(run_dir, signal.SIGUSR2, *FP16)
    state = torch.load(run_dir / "checkpoints" / str(step) / "train_state.pt", weights_only=True)
    ref = [m for m in read_metrics(reference["fp16"]) if "loss" in m]
    assert state["scaler"]["scale"] == ref[step - 1]["loss_scale"]
    assert ref[-1]["skipped_steps"] > 0 and len({m["loss_scale"] for m in ref}) > 2  # the scale moved
    finish(start(run_dir, *SLOW, *FP16), 0)
    resumed = [m for m in read_metrics(run_dir) if "loss" in m]
    keys = ("step", "loss", "loss_scale", "grad_norm", "lr", "skipped_steps")
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in ref]
    assert bitwise_equal(weights(run_dir), weights(reference["fp16"]))


def test_resume_on_one_rank_continues_the_sample_stream(tmp_path: Path, reference) -> None:
    """Issue 4 test 4: 2 ranks -> 1 rank at the same global batch continues at the right sample."""
    run_dir = tmp_path / "shrunk"
    preempt(run_dir, signal.SIGUSR2)
    finish(start(run_dir, *SLOW, "launcher.nproc_per_node=1"), 0)
    assert sample_stream(run_dir) == sample_stream(reference["fp32"])
    ref = [m["loss"] for m in read_metrics(reference["fp32"]) if "loss" in m]
    got = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert got == pytest.approx(ref, rel=1e-5)
    for name, tensor in weights(reference["fp32"]).items():
        torch.testing.assert_close(weights(run_dir)[name], tensor, rtol=1e-4, atol=1e-6)


def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, reference) -> None:
    """Issue 4 test 5: a truncated latest checkpoint is never loaded; the previous one is, with a warning."""
    run_dir = tmp_path / "truncated"
    step = preempt(run_dir, signal.SIGUSR2, "train.ckpt_every=10")
    weights_file = run_dir / "checkpoints" / str(step) / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    out = finish(start(run_dir, *SLOW, "train.ckpt_every=10"), 0)
    previous = step - step % 10 if step % 10 else step - 10
    assert f"checkpoint {run_dir / 'checkpoints' / str(step)} is unusable" in out
    assert f"resumed from step {previous}" in out
    assert bitwise_equal(weights(run_dir), weights(reference["fp32"]))


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_resume_policies_fail_fast_in_the_parent(tmp_path: Path) -> None:
    """resume=must without a checkpoint, resume=never over checkpoints, and a changed config (PITFALLS #25)."""
    fresh = tmp_path / "fresh"
    line = one_line_error(run_cli(*COMMON, "resume=must", f"hydra.run.dir={fresh}", cwd=tmp_path))
    assert "resume=must" in line and "no complete checkpoint" in line
    assert not fresh.exists()  # no half-made run dir left behind

    done = tmp_path / "done"
    assert run_cli(*COMMON, "train.max_steps=20", f"hydra.run.dir={done}", cwd=tmp_path).returncode == 0
    line = one_line_error(run_cli(*COMMON, "train.max_steps=20", "resume=never", f"hydra.run.dir={done}",
                                  cwd=tmp_path))
    assert "resume=never" in line
    line = one_line_error(run_cli(*COMMON, "train.max_steps=20", "optimizer.lr=0.5", f"hydra.run.dir={done}",
                                  cwd=tmp_path))
    assert "(optimizer.lr was 0.001, now 0.5)" in line and "resume.allow_config_change=true" in line
    # The same command again: the run finished, so the parent starts nothing and no file of the run changes
    files = {name: (done / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "launch.json", "config.yaml")}
    again = run_cli(*COMMON, "train.max_steps=20", f"hydra.run.dir={done}", cwd=tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    summary = json.loads(files["summary.json"])
    assert again.stdout.strip() == (f"run dir {done} already finished: 20 steps, final loss {summary['final_loss']:.4g}, "
                                    f"eval loss={summary['eval']['loss']:.4g}; nothing to run (to "
                                    f"train on, raise train.max_steps with resume.allow_config_change=true; to train "
                                    f"again, use a new hydra.run.dir)")
    assert files == {name: (done / name).read_bytes() for name in files}
    allowed = run_cli(*COMMON, "train.max_steps=30", "resume.allow_config_change=true", f"hydra.run.dir={done}",
                      cwd=tmp_path)
    assert allowed.returncode == 0 and "resumed from step 20" in allowed.stdout
    assert json.loads((done / "summary.json").read_text())["steps"] == 30
    line = one_line_error(run_cli(*COMMON, "train.max_steps=10", "resume.allow_config_change=true",
                                  f"hydra.run.dir={done}", cwd=tmp_path))
    assert line == (f"error: the latest checkpoint in {done} is step 30, past train.max_steps=10; raise "
                    f"train.max_steps, or use a new hydra.run.dir")
    # a config change the weights cannot follow: one line from the workers, before any tensor is copied
    out = run_cli(*COMMON, "train.max_steps=40", "model.hidden=16", "resume.allow_config_change=true",
                  f"hydra.run.dir={done}", cwd=tmp_path)
    line = out.stderr.strip()
    assert out.returncode == 1 and re.fullmatch(rf"error: rank \d failed: ConfigError: the checkpoint {done}/checkpoints/30 does not fit this "
                        r"model: 0\.bias is \[32\] there, \[16\] here; 0\.weight is \[32, 8\] there, \[16, 8\] here; 2\.weight .*; resume\.allow_config_change=true "
                        r"lets a run's config change, not its weights' shapes: .*", line), line


def test_consecutive_non_finite_steps_stop_the_run(tmp_path: Path) -> None:
    out = run_cli(*COMMON, "data.noise=nan", "train.max_bad_steps=3", f"hydra.run.dir={tmp_path / 'nan'}",
                  cwd=tmp_path)
    assert out.returncode == 1
    # every rank stops at the same agreed step; whichever the agent reports first names the key
    # one line, with the fix: no traceback of the launcher's own code, from any rank (it was 2 x 25 lines)
    assert re.fullmatch(r"error: rank \d failed: RuntimeError: 3 consecutive steps had non-finite gradients "
                        r"\(train\.max_bad_steps=3\); no checkpoint was written before them; lower optimizer\.lr \(it is "
                        r"0\.001\), look for inf or nan in the data, or raise train\.max_bad_steps "
                        r"\(run dir \S+\)\n", out.stderr), out.stderr[-2000:]
    assert [m["skipped_steps"] for m in read_metrics(tmp_path / "nan")] == [1, 2]
    assert [m["loss"] for m in read_metrics(tmp_path / "nan")] == [None, None]  # strict JSON: no NaN
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(tmp_path / "nan")],
                            capture_output=True, text=True, env=subprocess_env())
    assert status.returncode == 0 and "FAILED" in status.stdout and " inf/nan " in status.stdout, status.stderr[-2000:]
    # fewer steps than train.max_bad_steps, all skipped: the run ends, and says its weights are the initial ones
    short = run_cli(*COMMON, "data.noise=nan", "train.max_steps=2", "train.max_bad_steps=3",
                    f"hydra.run.dir={tmp_path / 'short'}", cwd=tmp_path)
    assert short.returncode == 0 and short.stderr.count("warning: all 2 steps had non-finite gradients and were "
                                                        "skipped: the weights are the initial ones") == 1, short.stderr


def test_batch_norm_statistics_are_rank_0_s_at_evals_and_checkpoints_so_a_resume_evaluates_the_same(
        tmp_path: Path) -> None:
    """BatchNorm's running statistics follow each rank's own batches (DDP's broadcast of buffers before each forward
    is off); every eval and checkpoint takes rank 0's on every rank. Before, each rank evaluated its share with its
    own statistics, and a run resumed at step 4 evaluated step 8 unlike the run that went on."""
    norm = ("+exp=toy", "model.batch_norm=true", "model.dtype=float64", "data.dtype=float64", "train.max_steps=8",
            "train.ckpt_every=4", "train.eval_every=4", "train.global_batch_size=16", "train.micro_batch_size=4")
    run_dir = tmp_path / "run"
    out = run_cli(*norm, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    evals = {m["step"]: m["eval"] for m in read_metrics(run_dir) if "eval" in m}
    final = weights(run_dir, 8)
    assert any(name.endswith("running_mean") for name in final)
    # the final eval is of the model the final checkpoint holds (rank 0's statistics), evaluated here in one process
    config = OmegaConf.load(run_dir / "config.yaml")
    task, model = instantiate(config.data), instantiate(config.model)
    model.load_state_dict(final)
    model.eval()
    with torch.no_grad():
        sums = [task.eval_sums(model, task.collate(task.eval_set[i:i + 4])) for i in range(0, len(task.eval_set), 4)]
    metrics = task.eval_metrics({key: sum(float(s[key]) for s in sums) for key in task.eval_sum_keys})
    assert metrics == pytest.approx(evals[8], rel=1e-12), (metrics, evals[8])
    for name in ("checkpoints/8", "summary.json"):  # as if it had stopped after step 4's checkpoint
        path = run_dir / name
        subprocess.run(["rm", "-r", str(path)], check=True)
    out = run_cli(*norm, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 4" in out.stdout
    again = {m["step"]: m["eval"] for m in read_metrics(run_dir) if "eval" in m}
    assert again == evals and bitwise_equal(weights(run_dir, 8), final), (again, evals)


def test_a_checkpoint_of_separate_tensors_does_not_load_into_tied_ones(tmp_path: Path) -> None:
    """Both files' tensors would be copied into the one parameter, the last winning (strategy=fsdp), or
    load_state_dict would list them under a traceback (DDP)."""
    from safetensors.torch import save_file

    from launcher.derived import ConfigError
    from launcher.train.checkpoint import _check_fits

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    weights = tmp_path / "model.safetensors"
    save_file({"0.weight": torch.zeros(5, 3), "1.weight": torch.zeros(5, 3)}, str(weights))
    _check_fits(model, weights)
    model[1].weight = model[0].weight
    with pytest.raises(ConfigError, match=r"does not fit this model: 1\.weight is tied to 0\.weight here, a tensor of "
                                          r"its own there; "):
        _check_fits(model, weights)
    save_file({"0.weight": torch.zeros(5, 3)}, str(weights))  # as safetensors saves tied weights: once
    _check_fits(model, weights)
