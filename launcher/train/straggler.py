"""Which rank is slow: each rank's compute time before it waits for the others, compared at log steps.

In synchronous DDP every rank's step lasts as long as the slowest rank's (the fast ones wait in the
all-reduces), so step times cannot show a straggler. What each rank spends before it waits can: the
forward and backward of micro-batches 1..K-1 and the last forward (the last backward waits in DDP's
all-reduce), after the step's first all-reduce. Timed with CUDA events on a GPU (GPU time, no host
sync), with the host clock on the CPU. At log steps one small all-reduce gives every rank all the sums. Not under
strategy=fsdp, whose gathers inside every forward and backward make every rank wait for the slowest there too.
Exercised by: tests/test_observability.py (a rank slowed on purpose is named).
"""
from __future__ import annotations

import statistics
import time

import torch

from launcher.train.dist import all_reduce_sum


class ComputeTimer:
    def __init__(self, device: torch.device, rank: int, world_size: int, sharded: bool = False):
        self.device, self.rank, self.world_size = device, rank, world_size
        self.cuda = device.type == "cuda"
        # One rank has nobody to compare with: no events, no host clock. Nor under strategy=fsdp (`sharded`): each
        # forward and backward gathers weights from every rank, so every rank's time before it waits holds the
        # others' too (a rank slowed on purpose read 1.00x, and was named as often as the other)
        self.on = world_size > 1 and not sharded
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s, self.started, self.last_s = 0.0, 0.0, 0.0

    def start(self) -> None:
        if not self.on:
            return
        if self.cuda:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if not self.on:
            return
        if self.cuda:
            stopped = torch.cuda.Event(enable_timing=True)
            stopped.record()
            self.spans.append((self.started, stopped))
        else:
            self.last_s = time.perf_counter() - self.started
            self.host_s += self.last_s

    def drop_last(self) -> None:
        """Forget the last start..stop: a step attempt dropped after running out of memory is redone, and only the
        attempt that counts is the step's compute."""
        if not self.on:
            return
        if self.cuda:
            self.spans.pop()
        else:
            self.host_s -= self.last_s

    def read(self) -> dict[str, float | int]:
        """The interval's compute time of the slowest rank over the median rank's; every rank calls it.
        Nothing with one rank (nobody to compare with)."""
        if not self.on:
            return {}
        if self.cuda:
            for _, stopped in self.spans[-1:]:
                stopped.synchronize()  # a log step: waiting here is fine
            seconds = sum(a.elapsed_time(b) for a, b in self.spans) / 1000
        else:
            seconds = self.host_s
        self.spans, self.host_s = [], 0.0
        per_rank = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        per_rank[self.rank] = seconds
        times = all_reduce_sum(per_rank).tolist()
        median = statistics.median(times)
        return {"step_time_max_over_median": max(times) / median if median > 0 else 1.0,
                "slowest_rank": max(range(len(times)), key=times.__getitem__)}
