"""train.best_metric: the best eval's checkpoint is kept beside the newest ones, across a resume, changes no
weight, and is what model.pretrained=<run dir> builds from."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_metrics, run_cli, subprocess_env
from helpers import COMMON, DROPOUT, bitwise_equal, finish, start, weights
from launcher.rundir import complete_steps
from launcher.train import checkpoint

pytestmark = pytest.mark.slow


def test_the_best_eval_s_checkpoint_outlives_the_rotation_and_a_resume(tmp_path: Path) -> None:
    """An eval that is the best so far is saved as a checkpoint at once and kept beside the newest
    train.keep_checkpoints, across a resume too; with dropout, the extra saves change no weight (a run that
    saves nothing in between, and one that ends at the best step, hold the same weights). best_mode=max on the
    toy's eval loss, which falls: the best is an early eval, not the last."""
    best = ("train.eval_every=2", "train.ckpt_every=0", "train.keep_checkpoints=1", "train.best_metric=loss",
            "train.best_mode=max", *DROPOUT)
    run_dir, plain, short = tmp_path / "best", tmp_path / "plain", tmp_path / "short"
    finish(start(run_dir, "train.max_steps=12", *best), 0)

    def expected_best() -> tuple[int, float]:  # the first of the highest eval losses, from the records
        evals = [(m["step"], m["eval"]["loss"]) for m in read_metrics(run_dir) if "eval" in m]
        return min(evals, key=lambda e: (-e[1], e[0]))

    step, value = expected_best()
    assert step < 12 and complete_steps(run_dir) == [step, 12]
    record = {"metric": "loss", "mode": "max", "step": step, "value": value,
              "checkpoint": str(run_dir / "checkpoints" / str(step))}
    assert json.loads((run_dir / "best.json").read_text()) == record
    assert json.loads((run_dir / "summary.json").read_text())["best"] == record
    finish(start(plain, "train.max_steps=12", "train.eval_every=2", *DROPOUT), 0)
    finish(start(short, f"train.max_steps={step}", "train.eval_every=2", *DROPOUT), 0)
    assert bitwise_equal(weights(run_dir, 12), weights(plain, 12))
    assert bitwise_equal(weights(run_dir, step), weights(short, step))

    # On to step 16: the resumed checkpoint's best goes on, and still protects its checkpoint from the rotation
    finish(start(run_dir, "train.max_steps=16", "resume.allow_config_change=true", *best), 0)
    assert expected_best() == (step, value) and complete_steps(run_dir) == [step, 16]
    assert json.loads((run_dir / "summary.json").read_text())["best"] == record
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(run_dir)], capture_output=True,
                            text=True, env=subprocess_env())
    assert f" loss={value:.4g}@{step} " in status.stdout.splitlines()[1], status.stdout + status.stderr

    # The final eval the best (best_mode=min of the falling loss): the best it replaced goes, best.json names it
    last = tmp_path / "last"
    finish(start(last, "train.max_steps=6", *best[:4], "train.best_mode=min"), 0)
    evals = [(m["step"], m["eval"]["loss"]) for m in read_metrics(last) if "eval" in m]
    assert [step for step, _ in evals] == [2, 4, 6] and min(evals, key=lambda e: e[1])[0] == 6
    assert complete_steps(last) == [6] and json.loads((last / "best.json").read_text())["step"] == 6

    following = tmp_path / "next"
    following.mkdir()
    choose = lambda: checkpoint._choose_pretrained(following, {"model": {"pretrained": str(run_dir)}},  # noqa: E731
                                                   True, print)["model"]["pretrained"]
    assert choose() == record["checkpoint"]
    (following / "pretrained.json").unlink()  # a new first start, of a run that tracked no best: the newest
    (run_dir / "best.json").unlink()
    assert choose() == str(run_dir / "checkpoints" / "16")


def test_a_best_metric_the_job_does_not_have_fails_before_the_first_step(tmp_path: Path) -> None:
    out = run_cli(*COMMON, "train.eval_every=2", "train.best_metric=accuracy", f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert out.returncode == 1 and not (tmp_path / "run" / "checkpoints").exists()
    assert re.search(r"^error: rank \d failed: ConfigError: train\.best_metric=accuracy is not an eval metric of this "
                     r"job \(loss\); name one of them, or null", out.stderr.strip().splitlines()[-1]), out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1  # (each rank printed its traceback: 40 lines above this one)
