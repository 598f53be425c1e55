"""Which samples each rank trains on at each optimizer step: a pure function of the step.

The samples of step s depend only on (seed, epoch, step, global batch size), never on the world size
or the accumulation: changing the cluster shape at a fixed global batch keeps the trajectory, and a
resume on any world size continues at the right sample. Exercised by: tests/test_data.py.
"""
from __future__ import annotations

import math
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from launcher.task import Task, count_tokens
from launcher.train.sample_order import epoch_key, permuted


@dataclass(frozen=True)
class DataPlan:
    n_samples: int
    global_batch_size: int
    seed: int
    drop_last: bool
    # the order of an epoch's samples: "feistel", a permutation read at any position in O(1)
    # (launcher/train/sample_order.py), or "randperm", torch.randperm of the whole train set at every step, which
    # run dirs started before the former go on with (their checkpoints name no order)
    order: str = "feistel"

    @property
    def steps_per_epoch(self) -> int:
        div = self.n_samples // self.global_batch_size
        return div if self.drop_last else math.ceil(self.n_samples / self.global_batch_size)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def step_indices(self, step: int) -> torch.Tensor:
        """Dataset indices of the whole step (all ranks); the last window of an epoch may be short."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        start = step_in_epoch * self.global_batch_size
        # A fresh permutation per (seed, epoch): reshuffled every epoch, reproducible per seed.
        if self.order == "randperm":
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            return torch.randperm(self.n_samples, generator=generator)[start:start + self.global_batch_size]
        positions = torch.arange(start, min(start + self.global_batch_size, self.n_samples))
        return permuted(positions, self.n_samples, epoch_key(self.seed, epoch))


def rank_share(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's contiguous slice of a step's (or eval set's) indices; sizes differ by at most one."""
    return torch.tensor_split(indices, world_size)[rank]


@dataclass
class Window:
    """One rank's part of one optimizer step, already split into micro-batches."""

    micro_batches: list[dict[str, Any]]
    step_samples: int  # samples in the whole step over all ranks (for samples/s without a sync)
    n_items: int  # items the loss sums over in this rank's window (0 when padding), counted on the CPU
    n_tokens: int | None = None  # non-pad tokens of this rank's window (text jobs), for tokens/s
    sample_ids: list[int] = field(default_factory=list)
    padding: bool = False  # this rank got no sample of a short window: one sample counted with weight 0
    repeats: int = 0  # the last micro-batches repeat one, counted with weight 0 (strategy=fsdp: see StepWindows)

    def pin_memory(self) -> "Window":  # called by DataLoader(pin_memory=True) on CUDA
        self.micro_batches = [pinned(b) for b in self.micro_batches]
        return self


def pinned(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors in pinned host memory: a non_blocking copy to the GPU then never waits for it."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class StepWindows(Dataset):
    """Item s = this rank's window of optimizer step s.

    `same_count` (strategy=fsdp): every rank runs as many micro-batches as rank 0, whose share is the largest, as
    each forward and backward enters FSDP's all-gathers and reduce-scatters: a rank whose short window splits into
    fewer repeats its last micro-batch with weight 0. (DDP needs no such thing: only its last backward syncs.)"""

    def __init__(self, task: Task, plan: DataPlan, rank: int, world_size: int, grad_accum_steps: int,
                 same_count: bool = False):
        self.task, self.plan = task, plan
        self.rank, self.world_size, self.grad_accum_steps = rank, world_size, grad_accum_steps
        self.same_count = same_count

    def __getitem__(self, step: int) -> Window:
        indices = self.plan.step_indices(step)
        mine = rank_share(indices, self.rank, self.world_size)
        padding = len(mine) == 0
        if padding:  # every rank must run a backward to join the one gradient all-reduce of the step
            mine = indices[:1]
        chunks = [c for c in torch.tensor_split(mine, self.grad_accum_steps) if len(c)]
        repeats = 0
        if self.same_count:  # rank 0's share: the first of tensor_split's pieces, never smaller than another's
            most = min(self.grad_accum_steps, len(rank_share(indices, 0, self.world_size)))
            repeats = most - len(chunks)
            chunks += chunks[-1:] * repeats
        if get_worker_info() is not None:  # in a loader process: what collate draws is a function of the step
            seed_worker_for(collate_seed(self.plan.seed, self.rank, step))
        batches = [self.task.collate([self.task.train_set[i] for i in c.tolist()]) for c in chunks]
        # Counted here, on the CPU batches (in a loader process when there are some): the step then needs
        # no read-back from, and no pageable copy to, the GPU to normalise its loss.
        counted = batches[:len(batches) - repeats]
        n_items = 0 if padding else sum(int(self.task.count_items(b)) for b in counted)
        tokens = [count_tokens(b) for b in counted]
        n_tokens = None if tokens[0] is None else 0 if padding else sum(tokens)
        return Window(batches, len(indices), n_items, n_tokens, [] if padding else mine.tolist(), padding, repeats)

    def __len__(self) -> int:
        raise TypeError("StepWindows is indexed by step; iterate it through window_loader")


def _keep(window: Window) -> Window:
    return window


def rank_seed(seed: int, rank: int, step: int) -> int:
    """A seed for `rank`'s random stream from `step` on: different for every rank and every step.
    Within the 64 bits torch's generators take (train.seed goes up to 2**32 - 1); a value that fitted is kept."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % 2**64


def collate_seed(seed: int, rank: int, step: int) -> int:
    """The seed of what collate draws in a loader process for `rank`'s window of `step`: apart from the
    rank's own stream (rank_seed), whose dropout masks it would otherwise repeat."""
    return rank_seed(seed, rank, step) ^ (1 << 62)


def seed_all(seed: int) -> None:
    """This process's torch (CUDA too) and Python random streams from `seed`."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA


@contextmanager
def random_streams_kept(device: torch.device) -> Iterator[None]:
    """What runs inside draws from no stream of this process's (torch's, the device's, Python's, numpy's): the
    job's parts tried before the first step leave the run's randomness as it would be without them."""
    python, numpy = random.getstate(), np.random.get_state()
    try:  # (also when what runs inside raises: launcher/train/loss_check.py goes on without its probe)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def seed_worker_for(seed: int) -> None:
    """A loader process's random streams (torch, random, numpy) from `seed`, before it collates a window.

    torch seeds its loader processes per loader iterator, and which process gets which step depends on
    where the iterator started: a job drawing random numbers in collate (augmentation) would draw others
    for the same step after a resume or with another train.num_workers. Seeded per step, it draws the
    same (for the same micro-batch split). Without loader processes collate draws from the rank's own
    stream, which a checkpoint saves and a resume restores; reseeding that one would repeat its dropout
    masks."""
    seed_all(seed)
    np.random.seed(seed % 2**32)  # numpy's global stream takes 32 bits


def window_loader(windows: StepWindows, steps: Iterable[int], num_workers: int, pin_memory: bool,
                  persistent_workers: bool = False, prefetch_factor: int = 2,
                  worker_init_fn: Callable[[int], None] | None = None) -> DataLoader:
    """Windows of the given steps, prepared ahead by `num_workers` processes (prefetch_factor each).

    The loader has a generator of its own: each iterator draws a seed for its workers, and from the
    global generator that draw would shift the rank's random stream (dropout) wherever a loader starts,
    e.g. on a resume, which would then draw other masks than the run it continues. Its seed differs per
    rank and per first step, as the global stream's draw did."""
    steps = list(steps)
    seed = rank_seed(windows.plan.seed, windows.rank, steps[0] if steps else 0)
    return DataLoader(windows, batch_size=None, sampler=steps, collate_fn=_keep,
                      num_workers=num_workers, pin_memory=pin_memory, worker_init_fn=worker_init_fn,
                      persistent_workers=persistent_workers and num_workers > 0,
                      prefetch_factor=prefetch_factor if num_workers else None,
                      generator=torch.Generator().manual_seed(seed))


class WindowStream:
    """Windows of steps first..last-1 in order, prepared ahead by a DataLoader; resplit() makes the next
    window the same step again, split for a new accumulation (a new loader: its workers split that way)."""

    def __init__(self, windows: StepWindows, first: int, last: int,
                 loader: Callable[[StepWindows, range], Iterable[Window]]):
        self.windows, self.first, self.last, self.loader = windows, first, last, loader
        self._again: int | None = None

    def resplit(self, grad_accum_steps: int) -> None:
        self._again = grad_accum_steps

    def __iter__(self) -> Iterator[Window]:
        step = self.first
        while step < self.last:
            ahead = iter(self.loader(self.windows, range(step, self.last)))
            try:
                for window in ahead:
                    yield window
                    if self._again is not None:
                        break
                    step += 1
            finally:  # a loader that prepares ahead in a thread stops it before the split changes
                getattr(ahead, "close", lambda: None)()
            if self._again is not None:
                self.windows.grad_accum_steps, self._again = self._again, None


def eval_batches(task: Task, rank: int, world_size: int, batch_size: int, pin: bool,
                 same_count: bool = False) -> Iterable[tuple[dict[str, Any], bool]]:
    """This rank's disjoint share of the eval set, each batch with whether it counts: no padding duplicates, so
    sums are exact (pinned on CUDA). `same_count` (strategy=fsdp, whose forwards enter collectives): as many
    batches as rank 0 has, the extra ones (its first sample's batch again) not counted."""
    assert task.eval_set is not None
    everything = torch.arange(len(task.eval_set))
    chunks = list(torch.split(rank_share(everything, rank, world_size), batch_size))
    most = len(torch.split(rank_share(everything, 0, world_size), batch_size)) if same_count else len(chunks)
    for i in range(most):
        chunk = chunks[i] if i < len(chunks) else everything[:1]
        batch = task.collate([task.eval_set[j] for j in chunk.tolist()])
        yield (pinned(batch) if pin else batch), i < len(chunks)
