"""A tiny deterministic regression job (an MLP on a fixed synthetic set) for smoke runs and tests.

Exercised by: `python -m launcher +exp=toy` (2 CPU ranks, a few seconds).
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn


def MLP(in_features: int, hidden: int, out_features: int, depth: int = 2, dtype: str = "float32",
        host_read: bool = False, dropout: float = 0.0, batch_norm: bool = False,
        untraceable: bool = False) -> nn.Module:
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth - 1):
        # tests: dropout draws from each rank's random stream in every forward, which a resume must continue;
        # batch_norm's running statistics (buffers) follow each rank's own batches
        layers += [nn.Linear(width, hidden), *([nn.BatchNorm1d(hidden)] if batch_norm else []), nn.Tanh(),
                   *([nn.Dropout(dropout)] if dropout else [])]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    # tests: host_read reads a value of the outputs on the host in the forward, which breaks a compiled graph;
    # untraceable ends the forward in an op that torch.compile cannot trace
    kind = HostReadingSequential if host_read else UntraceableSequential if untraceable else nn.Sequential
    return kind(*layers).to(getattr(torch, dtype))


# (named by this module: a job copied from this file registers an op of its own)
@torch.library.custom_op(f"{__name__.replace('.', '_')}::untraceable", mutates_args=())
def untraceable_op(x: torch.Tensor) -> torch.Tensor:
    """tests (model.untraceable): an op of the job's own without the fake implementation (torch.library's
    register_fake) that torch.compile traces it with, as a custom kernel may come."""
    return x.clone()


untraceable_op.register_autograd(lambda ctx, grad: grad)


class UntraceableSequential(nn.Sequential):
    """An MLP whose forward ends in an op torch.compile cannot trace (dynamo fails on the whole forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return untraceable_op(super().forward(x))


class HostReadingSequential(nn.Sequential):
    """An MLP whose forward reads a tensor value on the host (a graph break under torch.compile)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        if x.abs().max().item() > 1e6:  # .item() on the host: dynamo ends its graph here (a graph break)
            x = x * 0.5
        return x


class RunsOutInTheCopy(torch.Tensor):
    """tests (data.oom_in_copy): a batch's inputs, whose copy to the device runs out of memory when the job says."""

    task: ToyRegression

    def to(self, *args, **kwargs) -> torch.Tensor:
        if self.task.runs_out(len(self)):
            raise torch.OutOfMemoryError(f"test: more than {self.task.oom_max_items} samples, in the copy to the "
                                         f"device (jobs/toy.py)")
        return super().to(*args, **kwargs).as_subclass(torch.Tensor)


class LazySamples:
    """data.lazy=true: sample i of the same regression, drawn from (seed, i) when it is read: len() of 10^9 costs
    nothing, as a corpus on disk would not."""

    def __init__(self, n: int, a: torch.Tensor, b: torch.Tensor, noise: float, seed: int, dtype: torch.dtype):
        self.n, self.a, self.b, self.noise, self.seed, self.dtype = n, a, b, noise, seed, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(self.a.shape[0], generator=generator, dtype=self.dtype)
        y = torch.tanh(x @ self.a) @ self.b + self.noise * torch.randn(self.b.shape[1], generator=generator,
                                                                       dtype=self.dtype)
        return {"id": i, "x": x, "y": y}


class ToyRegression:
    """y = tanh(x A) B + noise on fixed Gaussian inputs; per-sample loss = mean squared error."""

    eval_sum_keys = ("loss_sum", "count")

    def __init__(self, n_samples: int = 1024, n_eval: int = 256, in_features: int = 8, out_features: int = 2,
                 noise: float = 0.05, seed: int = 1234, dtype: str = "float32", sleep_s: float = 0.0,
                 sleep_rank: int | None = None, stall_rank: int = -1, stall_at_call: int = 0, stall_s: float = 0.0,
                 oom_rank: int = -1, oom_max_items: int = 0, oom_from_call: int = 1, oom_in_backward: bool = False,
                 oom_in_eval: bool = False, oom_in_copy: bool = False, save_sleep_s: float = 0.0, lazy: bool = False,
                 collate_sleep_s: float = 0.0, collate_noise: float = 0.0):
        rank = int(os.environ.get("RANK", 0))
        # tests: collate takes this long per micro-batch (a job that tokenises or decodes), and adds noise drawn
        # from torch's global random stream to the inputs (augmentation without a generator of its own)
        self.collate_sleep_s, self.collate_noise = collate_sleep_s, collate_noise
        if save_sleep_s:  # tests: rank 0 takes this long to write each checkpoint (as on a slow file system)
            self.write_model_files = lambda model, directory: time.sleep(save_sleep_s)
        # per loss computation, on every rank or on sleep_rank only: lets tests signal or kill a run
        # mid-training, or make one rank a straggler
        self.sleep_s = sleep_s if sleep_rank in (None, rank) else 0.0
        # One rank stalls once, in its stall_at_call-th loss computation: lets tests make a rank hang
        self.stall_s = stall_s if rank == stall_rank else 0.0
        self.stall_at_call, self.calls = stall_at_call, 0
        # oom_rank pretends to run out of memory (torch.OutOfMemoryError) for any batch of more than
        # oom_max_items samples from its oom_from_call-th loss computation with gradients on (probe trials
        # included): in the forward, in the backward (where the last micro-batch's all-reduce runs), or as the
        # batch goes to the device (oom_in_copy, as on a nearly full GPU); with oom_in_eval also for every such
        # eval batch
        self.oom_max_items = oom_max_items if rank == oom_rank else None
        self.oom_from_call, self.oom_in_backward, self.grad_calls = oom_from_call, oom_in_backward, 0
        self.oom_in_eval, self.oom_in_copy = oom_in_eval, oom_in_copy and self.oom_max_items is not None
        generator = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype)
        a = torch.randn(in_features, 16, generator=generator, dtype=dt)
        b = torch.randn(16, out_features, generator=generator, dtype=dt) / 4
        if lazy:  # tests: a train set of any size (10^9), each sample made when read, as a corpus read from disk
            self.train_set = LazySamples(n_samples, a, b, noise, seed, dt)
            n_samples = 0  # the eval set below, made as usual
        x = torch.randn(n_samples + n_eval, in_features, generator=generator, dtype=dt)
        y = torch.tanh(x @ a) @ b + noise * torch.randn(len(x), out_features, generator=generator, dtype=dt)
        samples = [{"id": i, "x": x[i], "y": y[i]} for i in range(len(x))]
        self.eval_set = samples[n_samples:] or None
        if not lazy:
            self.train_set = samples[:n_samples]

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if self.collate_sleep_s:
            time.sleep(self.collate_sleep_s)
        x = torch.stack([s["x"] for s in samples])
        if self.collate_noise:
            x = x + self.collate_noise * torch.randn(x.shape, dtype=x.dtype)
        if self.oom_in_copy:
            x = x.as_subclass(RunsOutInTheCopy)
            x.task = self
        return {"id": torch.tensor([s["id"] for s in samples]), "x": x, "y": torch.stack([s["y"] for s in samples])}

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(len(batch["x"]))

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self.calls += 1
        if self.stall_s and self.calls == self.stall_at_call:
            time.sleep(self.stall_s)
        # model.dtype=bfloat16 (weights in bf16) on the fp32 data: the inputs go in the weights' dtype, as a
        # model's embedding would make them (a no-op at the default, where the model follows data.dtype)
        x, dtype = batch["x"], next(model.parameters()).dtype
        x = x if x.dtype == dtype else x.to(dtype)
        loss = ((model(x) - batch["y"]) ** 2).mean(dim=1).sum()
        if not self.oom_in_copy and self.runs_out(len(batch["x"])):
            if not self.oom_in_backward:
                raise torch.OutOfMemoryError(f"test: more than {self.oom_max_items} samples (jobs/toy.py)")
            loss.register_hook(self._out_of_memory)
        return loss

    def runs_out(self, n_samples: int) -> bool:
        """tests: whether oom_rank runs out of memory now, for a batch of n_samples with gradients on."""
        if self.oom_max_items is None or not torch.is_grad_enabled():
            return False
        self.grad_calls += 1
        return self.grad_calls >= self.oom_from_call and n_samples > self.oom_max_items

    def _out_of_memory(self, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError(f"test: more than {self.oom_max_items} samples, in backward (jobs/toy.py)")

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.oom_in_eval and self.oom_max_items is not None and len(batch["x"]) > self.oom_max_items:
            raise torch.OutOfMemoryError(f"test: more than {self.oom_max_items} samples, in eval (jobs/toy.py)")
        return {"loss_sum": self.loss_sum(model, batch), "count": self.count_items(batch)}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss_sum"] / max(sums["count"], 1)}
