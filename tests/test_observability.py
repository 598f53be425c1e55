"""What users see (issue 6): TensorBoard files mirroring metrics.jsonl, a progress bar on a TTY and plain
lines elsewhere, throughput and memory fields, the fp16 falling-scale warning, the summary table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import on_the_cpu_plan, read_metrics, run_cli, subprocess_env

pytestmark = pytest.mark.slow
TOY = ("+exp=toy", "train.max_steps=40", "train.log_every=10", "train.eval_every=20")


def test_tensorboard_mirrors_metrics_and_plain_lines_without_a_tty(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run_cli(*TOY, "precision=fp16", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [m for m in read_metrics(run_dir) if "loss" in m]
    for m in records:
        assert 0 <= m["data_wait_frac"] < 1 and m["peak_mem_mb"] > 0 and m["samples_per_sec"] > 0
        assert m["mfu"] is None  # no known peak on a CPU: reported as unknown, not invented
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_sec", "train/loss_scale",
            "train/peak_mem_mb", "train/data_wait_frac", "eval/loss"} <= tags
    tb_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert tb_loss == pytest.approx({m["step"]: m["loss"] for m in records}, rel=1e-6)
    assert [line for line in out.stdout.splitlines() if line.startswith("step ")][0].startswith("step 10/40 | ")
    assert "━" not in out.stdout  # no progress bar when stdout is not a terminal
    assert "│ samples_per_sec" in out.stdout and "│ skipped_steps" in out.stdout  # the summary table
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"steps", "wall_time_s", "samples_per_sec", "final_loss", "eval", "skipped_steps", "restarts",
            "peak_mem_mb", "checkpoint"} <= set(summary)


def test_progress_bar_on_a_tty(tmp_path: Path) -> None:
    """`script` runs the launcher on a pseudo-terminal, as a user's shell would."""
    typescript = tmp_path / "typescript"
    command = f"{sys.executable} -m launcher {' '.join(on_the_cpu_plan(TOY))} hydra.run.dir={tmp_path / 'run'}"
    out = subprocess.run(["script", "-qec", command, str(typescript)], cwd=tmp_path, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, typescript.read_text()[-3000:]
    screen = typescript.read_text()
    assert "━" in screen and "40/40" in screen and "loss " in screen


def test_fp16_scale_that_keeps_falling_is_warned_about(tmp_path: Path) -> None:
    """An absurd initial scale overflows step after step: the scale halves each time and the user is told."""
    out = run_cli("+exp=toy", "precision=fp16", "precision.init_scale=1e38", "train.max_steps=8", "train.log_every=1",
                  "train.max_bad_steps=100", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    scales = [m["loss_scale"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert all(b == a / 2 for a, b in zip(scales, scales[1:]))
    assert "warning: the fp16 loss scale keeps falling" in out.stderr and "try precision=bf16" in out.stderr
