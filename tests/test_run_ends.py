"""A run ends once: its command again starts nothing, workers that start after the final save (a restart on
their way out) record no second end, and an evaluation without training is not repeated for the same config.
(A sweep launched again: tests/test_cli.py; on a real Slurm cluster: tests/test_slurm.py.)"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch

from conftest import read_metrics, subprocess_env
from helpers import bitwise_equal, finish, start, weights
from launcher.rundir import EVAL_FILE, checkpoint_eval, complete_steps
from launcher.train.micro_batch import OUT_OF_MEMORY_EXIT_CODE

pytestmark = pytest.mark.slow
FOUR = ("train.max_steps=4",)


def restart_workers(run_dir: Path) -> str:
    """The workers alone, as torchrun's agent restarts them after a rank failed: no parent, no checks."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                          "launcher.train.worker", str(run_dir / "config.yaml")], env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def rewrite_train_state(step_dir: Path, **changes) -> None:
    """Change what a checkpoint's train_state.pt holds, and its checksum with it."""
    state_file, marker = step_dir / "train_state.pt", step_dir / "COMPLETE"
    torch.save({**torch.load(state_file, weights_only=True), **changes}, state_file)
    record = json.loads(marker.read_text())
    record["sha256"]["train_state.pt"] = hashlib.sha256(state_file.read_bytes()).hexdigest()
    marker.write_text(json.dumps(record))


def test_a_start_after_the_final_save_ends_the_run_once(tmp_path: Path) -> None:
    """Workers that start again after the final save train, evaluate and save nothing: the final save holds the
    run's final eval (beside it, in EVAL_FILE), and summary.json (with its time and throughput) stands. Without
    summary.json (the failure came before it) they write one with the run's final loss and eval. The control: a
    checkpoint of the last step without its eval, as a preemption saves it, is evaluated then."""
    run_dir = tmp_path / "run"
    finish(start(run_dir, *FOUR), 0)
    summary, metrics = (run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text()
    first = json.loads(summary)
    assert f"done: the run had ended before this start ({run_dir / 'summary.json'} stands)" in restart_workers(run_dir)
    assert (run_dir / "summary.json").read_text() == summary and (run_dir / "metrics.jsonl").read_text() == metrics

    (run_dir / "summary.json").unlink()  # the parent starts the workers when there is none
    out = finish(start(run_dir, *FOUR), 0)
    assert f"done: the run had trained its 4 steps before this start, final loss {first['final_loss']:.4g}" in out
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no second eval record
    again = json.loads((run_dir / "summary.json").read_text())
    assert (again["final_loss"], again["eval"], again["resumed_from"]) == (first["final_loss"], first["eval"], 4)
    assert complete_steps(run_dir) == [4]

    (run_dir / "checkpoints" / "4" / EVAL_FILE).unlink()
    (run_dir / "summary.json").unlink()
    finish(start(run_dir, *FOUR), 0)
    evals = [m["eval"] for m in read_metrics(run_dir) if "eval" in m]
    assert evals == [first["eval"]] * 2  # evaluated again, as the weights are the same: the same numbers
    assert json.loads((run_dir / "summary.json").read_text())["final_loss"] == first["final_loss"]
    assert checkpoint_eval(run_dir / "checkpoints" / "4")["eval"] == first["eval"]  # a next start finds it
    # A final checkpoint without its eval (the eval failed), resumed with more steps: its eval comes first, as a
    # preemption's at an eval step (else no eval of step 4 would ever be made)
    (run_dir / "checkpoints" / "4" / EVAL_FILE).unlink()
    (run_dir / "summary.json").unlink()
    finish(start(run_dir, "train.max_steps=6", "resume.allow_config_change=true"), 0)
    assert [(m["step"], m["eval"]) for m in read_metrics(run_dir) if "eval" in m][2:] == [(4, first["eval"]), (6, ANY)]


def test_a_final_eval_that_fails_loses_no_step(tmp_path: Path) -> None:
    """The final save came after the final eval: an eval that failed there lost every step since the checkpoint
    before (here all 8: train.ckpt_every=20). Rank 1 runs out of memory on eval batches of more than 2 samples,
    where training fits: the run exits for a relaunch at half the micro-batch (train.micro_batch_size=auto), its
    final checkpoint complete; the same command evaluates it, trains no step, and ends as the run whose eval fit."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    common = ("train.max_steps=8", "train.micro_batch_size=auto", "train.max_micro_batch_size=4",
              "model.dtype=float64", "data.dtype=float64")
    oom = ("data.oom_rank=1", "data.oom_max_items=2", "data.oom_from_call=1000000", "data.oom_in_eval=true")
    finish(start(reference, *common), 0)
    out = finish(start(run_dir, *common, *oom), OUT_OF_MEMORY_EXIT_CODE)
    assert "rank 1 ran out of memory in final eval after step 8" in out.strip().splitlines()[-1], out[-2000:]
    assert complete_steps(run_dir) == [8] and checkpoint_eval(run_dir / "checkpoints" / "8") is None
    out = finish(start(run_dir, *common, *oom), 0)
    assert "resumed from step 8" in out and "done: the run had trained its 8 steps before this start" in out
    assert bitwise_equal(weights(run_dir, 8), weights(reference, 8))
    ran, fitted = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    assert ran["micro_batch_size"] == 2 and fitted["micro_batch_size"] == 4
    assert ran["eval"]["loss"] == pytest.approx(fitted["eval"]["loss"], rel=1e-12)
    assert checkpoint_eval(run_dir / "checkpoints" / "8")["eval"] == ran["eval"]


def test_an_evaluation_without_training_runs_once_per_config(tmp_path: Path) -> None:
    """train.max_steps=0 again in its run dir starts nothing; with another config it evaluates again, and its
    record replaces the earlier start's (a fresh start keeps no record, a step-0 eval included)."""
    run_dir = tmp_path / "evaluate"
    out = finish(start(run_dir, "train.max_steps=0"), 0)
    assert "no step to train (train.max_steps=0) (" in out and "first step" not in out  # its start-up's last phase
    files = {name: (run_dir / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "launch.json")}
    def strict(constant: str) -> None:  # as JavaScript's JSON.parse: NaN and Infinity are no JSON
        raise ValueError(f"{constant} in summary.json")
    summary = json.loads(files["summary.json"], parse_constant=strict)
    evaluated = summary["eval"]
    assert summary["final_loss"] is None and "│ final_loss" not in out and "│ eval " in out  # no step, no loss
    again = finish(start(run_dir, "train.max_steps=0"), 0)
    assert f"run dir {run_dir} already evaluated without training: eval loss={evaluated['loss']:.4g}; nothing to run (to " \
           f"evaluate again, use a new hydra.run.dir or resume=never)" in again.splitlines()
    assert files == {name: (run_dir / name).read_bytes() for name in files}
    finish(start(run_dir, "train.max_steps=0", "train.seed=1"), 0)  # other initial weights
    records = read_metrics(run_dir)
    assert len(records) == 1 and records[0]["step"] == 0 and records[0]["eval"]["loss"] != evaluated["loss"]
    # The same config as the first evaluation, while config.yaml and summary.json are of the second: not the
    # same evaluation (summary.json's config hash tells), so it runs
    assert "already evaluated" not in finish(start(run_dir, "train.max_steps=0"), 0)
    assert [r["eval"] for r in read_metrics(run_dir)] == [evaluated]


def test_a_preemption_at_an_eval_step_evaluates_on_resume(tmp_path: Path) -> None:
    """The eval due at the preempted step comes first in the next start, on the weights the checkpoint holds:
    every step's eval exactly once, as in a run without the preemption (simulated: the checkpoint of step 4 of a
    run with evals every 2 steps says what a preemption there writes)."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    evals = ("train.eval_every=2",)
    finish(start(reference, "train.max_steps=8", *evals), 0)
    finish(start(run_dir, *FOUR, *evals), 0)
    step_dir = run_dir / "checkpoints" / "4"
    progress = torch.load(step_dir / "train_state.pt", weights_only=True)["progress"]
    rewrite_train_state(step_dir, progress={**progress, "eval_due": True})
    (step_dir / EVAL_FILE).unlink()
    records = [r for r in read_metrics(run_dir) if not ("eval" in r and r["step"] == 4)]  # as the preemption left
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))  # them: step 4 logged
    finish(start(run_dir, "train.max_steps=8", "resume.allow_config_change=true", *evals), 0)
    steps_and_evals = lambda d: [(m["step"], m["eval"]) for m in read_metrics(d) if "eval" in m]  # noqa: E731
    assert steps_and_evals(run_dir) == steps_and_evals(reference) and len(steps_and_evals(run_dir)) == 4
