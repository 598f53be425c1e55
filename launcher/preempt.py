"""Preemption: a signal only sets a flag; the ranks agree at the next step boundary, save one complete
checkpoint, and the launcher exits with REQUEUE_EXIT_CODE (Ctrl-C's SIGINT too: stopped, to go on later).

torchrun's agent relays the signals it is told to handle (`--signals-to-handle`) to every worker, so a
signal to the launcher's process reaches all ranks. Exercised by: tests/test_resume.py.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import FrameType

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "preempted, checkpoint saved, requeue me"
# The other exit code that asks for a new start (launcher/train/micro_batch.py): train.micro_batch_size=auto ran
# out of memory where a step cannot be redone, and the next start halves the micro-batch (Slurm: a requeue)
OUT_OF_MEMORY_EXIT_CODE = 76
REPEAT_S = 1.0  # a second SIGINT (Ctrl-C) later than this after the first stops the workers without their save
PREEMPTED_FILE = "preempted.json"  # written by rank 0 after the preemption checkpoint


def signal_named(name: str) -> signal.Signals | None:
    """`USR2`, `SIGUSR2` or `usr2` -> signal.SIGUSR2; None when there is no such signal."""
    found = getattr(signal, "SIG" + str(name).upper().removeprefix("SIG"), None)
    return found if isinstance(found, signal.Signals) else None


def preemption_signals(name: str) -> list[signal.Signals]:
    """SIGTERM (what schedulers and `kill` send), SIGINT (Ctrl-C: the run stops with a checkpoint, to go on
    later; a second Ctrl-C stops it at once) and the configured one (USR2: NCCL may own USR1)."""
    return sorted({signal.SIGTERM, signal.SIGINT, signal_named(name)})


def write_preempted(run_dir: Path, step: int, signum: int, saved: bool = True, started: bool = True) -> None:
    """preempted.json: the launch ended on a preemption signal; `step` is the checkpoint it resumes from (saved:
    written for this stop; else the newest before it, 0 for none: the workers ended before they saved, or never
    started)."""
    record = {"step": step, "signal": signum, "saved": saved, **({} if saved else {"started": started})}
    text = json.dumps(record) + "\n"
    try:  # an agent's record of a stop without a save never replaces rank 0's of its save (another node's agent
        # may see its workers end before rank 0 writes), while rank 0's replaces any
        with open(run_dir / PREEMPTED_FILE, "w" if saved else "x") as f:
            f.write(text)
    except FileExistsError:
        pass


def read_preempted(run_dir: Path) -> dict[str, int] | None:
    """The step, signal and `saved` of this run dir's preemption record (launcher/preempt.py), or None."""
    marker = run_dir / PREEMPTED_FILE
    return json.loads(marker.read_text()) if marker.exists() else None


def stop_line(record: dict[str, int], run_dir: Path, sweep_dir: Path | None = None, continues: bool = True) -> str:
    """What the launcher prints when a preemption signal ended its workers (of a point of a local sweep: the sweep's
    command resumes it, then runs the points after it; hydra.run.dir would resume that point alone). `continues`:
    the same command would continue the run dir (a local launch's; in a Slurm job's log, hydra.run.dir is named)."""
    step = record["step"]
    # 0: this rank was not signalled itself; it stopped with the ranks that were (a signal to one of them)
    name = signal.Signals(record["signal"]).name if record["signal"] else "a signal to another rank"
    how = "stopped" if record["signal"] == signal.SIGINT else "preempted"
    relaunch = (f"relaunch the sweep's command with hydra.sweep.dir={sweep_dir} (its finished points are skipped) to"
                if sweep_dir else  # (a command without hydra.run.dir continues its unfinished run: continue_run.py)
                f"run the same command again (it continues in {run_dir}; or add hydra.run.dir={run_dir}) to" if continues
                else f"relaunch with hydra.run.dir={run_dir} to")  # (a Slurm job's point of a sweep, for one)
    if record.get("saved", True):
        return f"{how} by {name}: checkpoint saved at step {step}; {relaunch} resume (exit code {REQUEUE_EXIT_CODE})"
    when = ("before the workers started" if not record.get("started", True) else
            # which of these, only the workers' own lines say, and a worker stopped while it starts says none
            "before the workers saved a checkpoint (stopped while they started, stopped a second time, or their save "
            "failed or took longer than launcher.shutdown_timeout_s)")
    return (f"{how} by {name} {when}; {relaunch} {f'resume from step {step}' if step else 'start over'} "
            f"(exit code {REQUEUE_EXIT_CODE})")


class StopFlag:
    """Set by the signal handler; read once per step, where all ranks agree on it."""

    def __init__(self, signals: list[signal.Signals]):
        self.signum, self.signals, self.since = 0, tuple(signals), 0.0
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Ctrl-C, then a second signal (the agent relays a second Ctrl-C as SIGTERM): end now, without the save.
        # Not within a second: Slurm's SIGINT (scancel --signal=INT, an srun's Ctrl-C) reaches every process of
        # the step, so a worker gets it twice, from Slurm and from the agent's relay, a moment apart.
        if self.signum == signal.SIGINT and time.monotonic() - self.since > REPEAT_S:
            os._exit(128 + signal.SIGINT)
        if not self.signum:
            self.signum, self.since = signum, time.monotonic()  # no I/O, no collectives in a handler (Lightning#21406)

    @property
    def requested(self) -> bool:
        return self.signum != 0


# The launcher's process, from its start until its workers start: a scheduler's stop is kept, not fatal
EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
_early: list[StopFlag] = []  # the launcher process's one flag, once keep_early_signals has run


def keep_early_signals() -> None:
    """SIGTERM or USR2 (launcher.signal's default) while no agent runs, in compose, the checks or between the
    points of a local sweep, ended the process with no word (exit 143). Kept instead, it ends the next start of
    workers before it begins, as a preemption: exit 75, and the requeue goes on. (Ctrl-C there stays Python's: launcher/interrupted.py.)"""
    _early.append(StopFlag(list(EARLY_SIGNALS)))


def early_signal() -> int:
    """The signal kept by keep_early_signals (0: none)."""
    return _early[0].signum if _early else 0


def release_early_signals() -> None:
    """A launch that starts no agent here (launcher=slurm submits, and may wait): the signals act as by default
    again, and one kept meanwhile acts now."""
    for sig in EARLY_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if early_signal():
        os.kill(os.getpid(), early_signal())


def ignore_in_data_workers(worker_id: int, signals: tuple[signal.Signals, ...] = ()) -> None:
    """DataLoader workers must not die of a preemption signal sent to the whole process tree."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
