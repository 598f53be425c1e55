"""Start-up, phase by phase: rank 0 says each phase as it begins, with the seconds since the launch, so that the
wait before the first step (rendezvous, building the job, loading a checkpoint, compiling) is visible.

Exercised by: tests/test_failures_on_record.py.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.rundir import LOG_FILE

LAUNCH_TIME = "LAUNCHER_LAUNCH_TIME"  # when this start was launched (time.time()), set for the workers by their agent


def phase(run_dir: Path, is_main: bool, what: str) -> None:
    """Rank 0 prints `what` with the time since the launch, and keeps the line in launcher.log."""
    if not is_main:
        return
    launched = float(os.environ.get(LAUNCH_TIME) or time.time())
    line = f"{what} ({time.time() - launched:.1f}s after the launch)"
    print(line, flush=True)
    with open(run_dir / LOG_FILE, "a") as log:
        log.write(line + "\n")
