"""Where training stands, kept by the host from each step's agreed flags, read one step late.

A step's flags (did any rank see a non-finite gradient, was any rank asked to stop) are agreed in the
step's all-reduce on the device. Reading them at once would make the CPU wait for the GPU every step, so
they are copied to pinned host memory without blocking and read just before the NEXT step's update: by
then the GPU has long finished them (the next step's forward and backward are queued behind them), so
the read costs nothing. The scheduler steps there too: after each real update and before the next one,
so the learning rate of every update is exactly what it would be if the flag were read at once. Log,
eval and checkpoint steps settle first, so what they record is exact.
Exercised by: tests/test_distributed_math.py (fp16 skips) and tests/test_gpu.py (no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from launcher.rundir import CHECKPOINTS_DIR, complete_steps
from launcher.train.sync_check import host_side


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint, restored on resume."""

    step: int = 0  # optimizer steps done (windows consumed, skipped steps included)
    samples: int = 0  # samples consumed
    skipped_steps: int = 0
    bad_in_a_row: int = 0  # consecutive steps with non-finite gradients
    last_loss: float = float("nan")  # the loss last logged (the summary's final loss, also after a restart)
    eval_due: bool = False  # a preemption came at an eval step: the resumed start evaluates it first


class HostCopy:
    """A small device tensor on its way to the host: copied without blocking, read when it has arrived."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.arrived: torch.cuda.Event | None = torch.cuda.Event()
            self.arrived.record()
        else:
            self.host, self.arrived = tensor, None

    def read(self) -> list[float]:
        if self.arrived is not None:
            self.arrived.synchronize()  # waits for this copy only, which the GPU finished a step ago
        with host_side():  # train.sync_check: a CPU run's stand-in for the pinned copy's read
            return self.host.tolist()


class StepLedger:
    """The host's view of the agreed step flags: skipped steps, the scheduler, the stop request."""

    def __init__(self, progress: Progress, scheduler: torch.optim.lr_scheduler.LRScheduler, max_bad_steps: int,
                 run_dir: Path):
        self.progress, self.scheduler, self.max_bad_steps = progress, scheduler, max_bad_steps
        self.run_dir = run_dir
        self.pending: HostCopy | None = None
        self.stop = False  # some rank was asked to stop (preemption): every rank stops at the same step

    def record(self, nonfinite: torch.Tensor, stop: torch.Tensor) -> None:
        """This step's agreed flags (summed over ranks), read at the next settle()."""
        self.pending = HostCopy(torch.stack([nonfinite, stop]))

    def settle(self) -> None:
        """Read the pending flags: count the step as real (the scheduler steps) or skipped."""
        if self.pending is None:
            return
        nonfinite, stop = self.pending.read()
        self.pending = None
        self.stop = self.stop or stop > 0
        if nonfinite:  # skipped on every rank alike: the schedule counts real updates only (Lightning#18828)
            self.progress.skipped_steps += 1
            self.progress.bad_in_a_row += 1
        else:
            self.progress.bad_in_a_row = 0
            self.scheduler.step()
        if self.progress.bad_in_a_row >= self.max_bad_steps:  # the flags are agreed: every rank stops here
            kept = (f"the last complete checkpoint is kept in {self.run_dir / CHECKPOINTS_DIR}"
                    if complete_steps(self.run_dir) else "no checkpoint was written before them")
            lr = self.scheduler.base_lrs[0]  # optimizer.lr (a diverging run is the config's or the data's: the fix)
            error = RuntimeError(f"{self.progress.bad_in_a_row} consecutive steps had non-finite gradients "
                                 f"(train.max_bad_steps={self.max_bad_steps}); {kept}; lower optimizer.lr (it is "
                                 f"{lr:g}), look for inf or nan in the data, or raise train.max_bad_steps")
            error.one_line = True  # the launcher's line says it all; no traceback of the launcher's own code
            raise error
