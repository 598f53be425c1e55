"""train.num_workers=auto: a rank's windows prepared ahead of its steps, in loader processes or a thread.

`auto` never changes what a run trains on: where collate draws from the global random streams (torch's,
Python's, numpy's), the windows stay on the training thread, exactly as train.num_workers=0 makes them; else
they come from loader processes where the rank has spare cores, from one background thread where it has not.
A loader process or a thread that makes the same window as the training thread would is then only faster.
Exercised by: tests/test_prefetch.py.
"""
from __future__ import annotations

import os
import queue
import random
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from launcher.train.data import StepWindows, Window, window_loader

MAX_PROCESSES = 4  # more only help a collate slower than 4 steps; each holds a copy of what it touches


def usable_cores() -> int:
    """The cores this process may run on (a Slurm allocation or taskset narrows them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def spare_cores(device: torch.device) -> int:
    """Cores of this rank's share of the node that its training does not use: on a GPU the training thread
    holds one; on the CPU its intra-op threads compute (torchrun sets 1 per rank when a node runs several)."""
    per_rank = usable_cores() // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    return per_rank - (1 if device.type == "cuda" else torch.get_num_threads())


def loader_processes(spare: int) -> int:
    """Loader processes for `spare` cores: none below 2, where one thread prepares as much without a process's
    start-up and copy of the data set."""
    return min(spare, MAX_PROCESSES) if spare >= 2 else 0


def global_streams() -> tuple[Any, ...]:
    """The state of the random streams a collate draws from unless given a generator."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def draws_from_global_streams(make: Callable[[], Any]) -> tuple[Any, bool]:
    """make()'s result, and whether it drew from torch's, Python's or numpy's global random stream."""
    (torch_before, *rest_before), result = global_streams(), make()
    torch_after, *rest_after = global_streams()
    drew = not torch.equal(torch_before, torch_after) or any(
        not _same(a, b) for a, b in zip(rest_before, rest_after))
    return result, drew


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class AutoPrefetch:
    """The loader of train.num_workers=auto, a drop-in for window_loader's `loader` role in WindowStream: the
    first window it makes is made here, on the training thread, and tells where the rest are made."""

    def __init__(self, device: torch.device, prefetch_factor: int, worker_init_fn: Callable[[int], None] | None,
                 say: Callable[[str], None]):
        self.device, self.prefetch_factor, self.worker_init_fn, self.say = device, prefetch_factor, worker_init_fn, say
        self.processes = loader_processes(spare_cores(device))
        self.where: str | None = None  # "processes", "thread" or "training thread", once the first window is made

    def __call__(self, windows: StepWindows, steps: Iterable[int]) -> Iterator[Window]:
        steps, pin = list(steps), self.device.type == "cuda"
        if self.where is None and steps:
            window, drew = draws_from_global_streams(lambda: windows[steps[0]])
            self.where = "training thread" if drew else "processes" if self.processes else "thread"
            self.say(self.described(drew))
            yield window.pin_memory() if pin else window
            steps = steps[1:]
        processes = self.processes if self.where == "processes" else 0
        loader = window_loader(windows, steps, processes, pin, prefetch_factor=self.prefetch_factor,
                               worker_init_fn=self.worker_init_fn)
        if self.where != "thread":
            yield from loader
            return
        ahead = ThreadPrefetch(loader, self.prefetch_factor, self.device)
        try:
            yield from ahead
        finally:  # the stream stopped early (a resplit, a preemption): the thread stops before anything changes
            ahead.close()

    def described(self, drew: bool) -> str:
        if drew:
            return ("train.num_workers=auto: collate draws from the global random streams, so windows are made on the "
                    "training thread, as with 0 (set train.num_workers=N for loader processes, seeded per step)")
        if self.where == "processes":
            return f"train.num_workers=auto: {self.processes} loader processes prepare windows ahead"
        return "train.num_workers=auto: a background thread prepares windows ahead (no spare core for processes)"


_END = object()


class ThreadPrefetch:
    """Items of `iterable` made `depth` ahead by one daemon thread; its errors are raised where they are read.
    (collate in native code, a tokenizer or a file read, releases the GIL, and so overlaps the step.)"""

    def __init__(self, iterable: Iterable[Any], depth: int, device: torch.device):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iterable, device), name="launcher-prefetch",
                                        daemon=True)
        self._thread.start()

    def _fill(self, iterable: Iterable[Any], device: torch.device) -> None:
        if device.type == "cuda":  # pinned memory is allocated for the rank's own GPU
            torch.cuda.set_device(device)
        try:
            for item in iterable:
                if not self._put((item, None)):
                    return
        except BaseException as error:  # noqa: BLE001 - any error is the reader's, with its traceback
            self._put((None, error))
            return
        self._put((_END, None))

    def _put(self, entry: tuple[Any, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        while True:
            item, error = self._queue.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item

    def close(self) -> None:
        """Stop making items; returns once the thread has finished the one it was making."""
        self._stop.set()
        self._thread.join()
