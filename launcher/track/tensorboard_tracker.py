"""TensorBoard: event files in <run_dir>/tb/, the tracker on by default (logger=[tensorboard]).
Exercised by: `python -m launcher +exp=toy`, then `tensorboard --logdir runs/`.
"""
from __future__ import annotations

from pathlib import Path

from launcher.track.protocol import Resume, Tracker


class TensorBoardTracker(Tracker):
    """Event files in <run_dir>/tb/; a resumed run purges the events after its step (purge_step)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume: Resume):
        purge = resume.step or resume.lost  # a restart before the first checkpoint purges from step 1
        self.dir, self.purge_step, self._writer = run_dir / "tb", resume.step + 1 if purge else None, None

    def log(self, step: int, scalars: dict[str, float], kind: str) -> None:
        if self._writer is None:  # made at the first log, not before the first step: the import is slow
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir), purge_step=self.purge_step)
        for key, value in scalars.items():
            self._writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
