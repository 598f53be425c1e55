"""The same command continues: run again after Ctrl-C, a command without hydra.run.dir goes on in its unfinished run
dir, to the weights of an uninterrupted run (launcher/launch/continue_run.py)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import on_the_cpu_plan, subprocess_env
from helpers import bitwise_equal, logged_step, wait_until, weights

pytestmark = pytest.mark.slow
COMMAND = ("+exp=toy", "launcher.nproc_per_node=1", "train.max_steps=60", "train.log_every=1", "train.eval_every=0",
           "train.global_batch_size=16", "train.micro_batch_size=4", "model.dropout=0.3", "data.sleep_s=0.01")


def launch(cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", *on_the_cpu_plan([*COMMAND, *extra])], cwd=cwd,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_same_command_after_ctrl_c_continues_its_run_dir_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    first = launch(tmp_path)
    wait_until(lambda: any(logged_step(d) >= 20 for d in (tmp_path / "runs" / "toy").glob("*")))
    first.send_signal(signal.SIGINT)  # Ctrl-C: a checkpoint, then exit
    out, err = first.communicate(timeout=120)
    assert first.returncode != 0, out + err
    (run_dir,) = (tmp_path / "runs" / "toy").iterdir()

    again = launch(tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out[-2000:] + err[-3000:]
    assert out.splitlines()[0].startswith(f"continuing run dir {run_dir}: the last run of this same command is "
                                          f"unfinished"), out
    assert "resumed from step" in out and [d.name for d in (tmp_path / "runs" / "toy").iterdir()] == [run_dir.name]

    uninterrupted = tmp_path / "uninterrupted"  # (hydra.run.dir given: a new run, whatever ran before)
    whole = launch(tmp_path, f"hydra.run.dir={uninterrupted}")
    out, err = whole.communicate(timeout=300)
    assert whole.returncode == 0 and "continuing" not in out, err[-3000:]
    assert bitwise_equal(weights(run_dir, 60), weights(uninterrupted, 60))
