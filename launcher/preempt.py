"""Preemption: a signal only sets a flag; the ranks agree at the next step boundary, save one complete
checkpoint, and the launcher exits with REQUEUE_EXIT_CODE.

torchrun's agent relays the signals it is told to handle (`--signals-to-handle`) to every worker, so a
signal to the launcher's process reaches all ranks. Exercised by: tests/test_resume.py.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
from types import FrameType

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "preempted, checkpoint saved, requeue me"
# The other exit code that asks for a new start (launcher/train/micro_batch.py): train.micro_batch_size=auto ran
# out of memory where a step cannot be redone, and the next start halves the micro-batch (Slurm: a requeue)
OUT_OF_MEMORY_EXIT_CODE = 76
PREEMPTED_FILE = "preempted.json"  # written by rank 0 after the preemption checkpoint


def signal_named(name: str) -> signal.Signals | None:
    """`USR2`, `SIGUSR2` or `usr2` -> signal.SIGUSR2; None when there is no such signal."""
    found = getattr(signal, "SIG" + str(name).upper().removeprefix("SIG"), None)
    return found if isinstance(found, signal.Signals) else None


def preemption_signals(name: str) -> list[signal.Signals]:
    """SIGTERM (what schedulers and `kill` send) plus the configured one (USR2: NCCL may own USR1)."""
    return sorted({signal.SIGTERM, signal_named(name)})


def read_preempted(run_dir: Path) -> dict[str, int] | None:
    """The step and signal of this run dir's preemption checkpoint, or None."""
    marker = run_dir / PREEMPTED_FILE
    return json.loads(marker.read_text()) if marker.exists() else None


class StopFlag:
    """Set by the signal handler; read once per step, where all ranks agree on it."""

    def __init__(self, signals: list[signal.Signals]):
        self.signum, self.signals = 0, tuple(signals)
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum  # nothing else: no I/O and no collectives inside a handler (Lightning#21406)

    @property
    def requested(self) -> bool:
        return self.signum != 0


def ignore_in_data_workers(worker_id: int, signals: tuple[signal.Signals, ...] = ()) -> None:
    """DataLoader workers must not die of a preemption signal sent to the whole process tree."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
