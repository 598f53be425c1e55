"""`train.profile=[first,last]`: a torch.profiler trace of those optimizer steps, on `train.profile_ranks`.

Each profiled rank writes <run_dir>/profile/rank<N>.steps<first>-<last>.pt.trace.json (the steps it
recorded: fewer when the run resumed inside the range or was preempted in it; Chrome trace
format: open it in ui.perfetto.dev or chrome://tracing; `tensorboard --logdir <run_dir>/profile` shows it
too), each step marked `step <n>`. Off by default, and then it costs one comparison per step.
Exercised by: tests/test_observability.py.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch

PROFILE_DIR = "profile"


class StepProfiler:
    def __init__(self, run_dir: Path, rank: int, steps: list[int] | None, ranks: list[int], device: torch.device):
        self.dir = run_dir / PROFILE_DIR if steps else None  # where the traces of all profiled ranks go
        self.rank = rank
        self.first, self.last = (steps[0], steps[1]) if steps and rank in ranks else (0, -1)
        self.recorded = [0, 0]  # the first and last step recorded so far
        self.activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler: torch.profiler.profile | None = None

    def step(self, step: int) -> AbstractContextManager:
        """Around optimizer step `step` (1-based): records it when it is one of the profiled steps."""
        return self._recorded(step) if self.first <= step <= self.last else nullcontext()

    @contextmanager
    def _recorded(self, step: int) -> Iterator[None]:
        if self.profiler is None:  # the first profiled step (or the first after a resume inside the range)
            self.profiler = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self.profiler.start()
            self.recorded = [step, step]
        with torch.profiler.record_function(f"step {step}"):
            yield
        self.recorded[1] = step
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Write the trace of the steps recorded so far (all of them, unless the run stopped early)."""
        if self.profiler is None:
            return
        self.profiler.stop()  # waits for the GPU's kernels of the recorded steps
        trace = self.dir / f"rank{self.rank}.steps{self.recorded[0]}-{self.recorded[1]}.pt.trace.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(trace))
        self.profiler = None
