"""The fallbacks for torch builds older than the features the launcher prefers (launcher/compat.py), on
every CI run: real 2-rank jobs with the installed torch made to look like the floor, torch 2.6
(tests/torch_floor/sitecustomize.py hides torchrun's --signals-to-handle and --shutdown-timeout and DDP's
forward_sync_buffers, as 2.6 lacks them).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, subprocess_env
from helpers import SLOW, bitwise_equal, finish, preempt, sample_stream, start, weights

pytestmark = pytest.mark.slow
FLOOR_ENV = subprocess_env(PYTHONPATH=f"{REPO / 'tests' / 'torch_floor'}{os.pathsep}{REPO}")


def test_the_floor_torch_is_what_the_launcher_detects() -> None:
    """The control: with the floor folder on the path, compat sees a torch without the newer features."""
    probe = ("from launcher import compat; from launcher.launch import local; from launcher.launch.plan import Plan; "
             "from omegaconf import OmegaConf; "
             "plan = Plan(1, 2, 2, 1, 'cpu'); cfg = OmegaConf.create({'signal': 'USR2', 'shutdown_timeout_s': 120, "
             "'max_restarts': 0}); print(compat.DDP_NO_FORWARD_BUFFER_SYNC, "
             "local.torchrun_args(__import__('pathlib').Path('c.yaml'), plan, cfg, ['--standalone']))")
    floor = subprocess.run([sys.executable, "-c", probe], env=FLOOR_ENV, capture_output=True, text=True)
    today = subprocess.run([sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, text=True)
    assert floor.returncode == today.returncode == 0, floor.stderr + today.stderr
    assert "{'broadcast_buffers': False}" in floor.stdout
    assert "signals-to-handle" not in floor.stdout and "shutdown-timeout" not in floor.stdout
    # The installed torch: the newer spellings from the releases that added them (a GPU image may be older)
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert ("{'forward_sync_buffers': False}" in today.stdout) == (version >= (2, 13))
    assert ("--signals-to-handle=SIGHUP,SIGINT,SIGQUIT,SIGTERM,SIGUSR2" in today.stdout) == (version >= (2, 10))
    assert ("--shutdown-timeout=120" in today.stdout) == (version >= (2, 12))


def test_on_the_floor_a_run_trains_preempts_and_resumes_exactly(tmp_path: Path, reference) -> None:
    """USR2 to the launcher: torchrun of 2.6 would not relay it (and USR2 would kill the launcher); the
    launcher relays it, the workers checkpoint and exit 75, and the resumed run ends bitwise equal to an
    uninterrupted run on today's torch (broadcast_buffers=False changes nothing for the trajectory)."""
    run_dir = tmp_path / "floor"
    step = preempt(run_dir, signal.SIGUSR2, env=FLOOR_ENV)
    out = finish(start(run_dir, *SLOW, env=FLOOR_ENV), 0)
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2, out[-3000:]  # one line per missing torchrun feature, saying what it costs
    assert "relays SIGUSR2 to the workers itself" in notes[0]
    assert "fixed 30 s" in notes[1] and "launcher.shutdown_timeout_s=120" in notes[1]
    assert f"resumed from step {step}" in out
    assert bitwise_equal(weights(run_dir), weights(reference["fp32"]))
    assert sample_stream(run_dir) == sample_stream(reference["fp32"])
