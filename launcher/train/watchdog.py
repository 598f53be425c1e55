"""Hang reports: which rank stopped where, from the run dir alone, without rerunning.

Each worker runs a watchdog thread. When its training loop has not moved on for `dist.hang_timeout_s`,
it writes <run_dir>/hang/rank<N>.txt: one JSON line (step, phase, the innermost frame of our own code,
seconds stalled), then every thread's Python stack. A rank that moves on again removes its report (it
was slow, not hung). When the run then fails, the launcher names the ranks that were not where the
others were (launcher/launch/local.py). Exercised by: tests/test_hang.py.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from launcher.rundir import HANG_DIR

CODE = Path(__file__).resolve().parents[2]  # the checkout: frames under its launcher/ and jobs/ are ours
OWN_CODE = tuple(str(CODE / part) + os.sep for part in ("launcher", "jobs"))
WAITING = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}autograd{os.sep}")
# Our own places where the host waits for the GPU, which may wait for the other ranks (NCCL does not block
# the host: a rank waiting for its peers on a GPU blocks in the next read of a GPU value)
WAITING_OWN = ("launcher/train/dist.py", "launcher/train/ledger.py", "launcher/train/meter.py",
               "launcher/train/straggler.py")


def _own(path: str) -> str | None:
    """`launcher/train/step.py` for a file of ours, else None."""
    return next((path[len(str(CODE)) + 1:] for prefix in OWN_CODE if path.startswith(prefix)), None)


def innermost_own_frame(frame: FrameType | None) -> str:
    """`jobs/toy.py:52 loss_sum`: where in our code (launcher/ or jobs/) a stack is, innermost first."""
    while frame is not None:
        own = _own(frame.f_code.co_filename)
        if own and own != "launcher/train/watchdog.py":
            return f"{own}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside launcher/ and jobs/"


def waits_for_peers(frame: FrameType | None) -> bool:
    """In a collective (torch.distributed), in a backward (where DDP waits for its all-reduce), or in one
    of our places that wait for the GPU. Only the frames up to our innermost one count (the worker itself
    runs inside torch.distributed.elastic's error recorder)."""
    while frame is not None:
        path = frame.f_code.co_filename
        own = _own(path)
        if own:
            return own in WAITING_OWN
        if WAITING[0] in path or (WAITING[1] in path and "backward" in frame.f_code.co_name):
            return True
        frame = frame.f_back
    return False


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float):
        self.report = run_dir / HANG_DIR / f"rank{rank}.txt"
        self.report.unlink(missing_ok=True)  # an earlier attempt's (before a restart or a requeue)
        self.rank, self.timeout_s = rank, timeout_s
        self.phase, self.step, self.since, self.reported, self.closed = "start-up", 0, time.monotonic(), False, False
        self.watched = threading.get_ident()  # the thread that trains
        threading.Thread(target=self._watch, name="launcher-watchdog", daemon=True).start()

    def at(self, phase: str, step: int) -> None:
        """The loop moved on: `phase` (train, log, eval, checkpoint) of `step` starts now. Costs nothing."""
        self.phase, self.step, self.since = phase, step, time.monotonic()
        if self.reported:  # it moved on: slow, not hung
            self._take_back()

    def close(self) -> None:
        """The run is over (done or preempted): stop watching; a report written meanwhile is taken back."""
        self.closed = True
        self._take_back()

    def _watch(self) -> None:
        while not self.closed:
            time.sleep(min(1.0, self.timeout_s / 4))
            since = self.since
            if not self.reported and not self.closed and time.monotonic() - since >= self.timeout_s:
                self._write(time.monotonic() - since)
                self.reported = True
                if self.since != since or self.closed:  # it moved on while we wrote: at() may have looked too early
                    self._take_back()

    def _take_back(self) -> None:
        self.reported = False
        try:
            self.report.unlink(missing_ok=True)
        except OSError:  # a report we cannot remove must not stop training
            pass

    def _write(self, stalled_s: float) -> None:
        frame = sys._current_frames().get(self.watched)
        header = {"rank": self.rank, "step": self.step, "phase": self.phase, "where": innermost_own_frame(frame),
                  "waiting": waits_for_peers(frame), "stalled_s": round(stalled_s, 1)}
        tmp = self.report.with_suffix(".tmp")
        try:
            self.report.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(json.dumps(header) + "\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            os.replace(tmp, self.report)
        except OSError as err:  # disk full, a vanished file system: say so once, keep watching
            print(f"warning: rank {self.rank} could not write its hang report {self.report}: {err}",
                  file=sys.stderr, flush=True)
