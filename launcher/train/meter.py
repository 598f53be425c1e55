"""Throughput, memory and MFU of a log interval, accumulated on the device (no host sync per step) and
read out only at log steps. Exercised by: `python -m launcher +exp=bert` (metrics.jsonl, tb/).
"""
from __future__ import annotations

import re
import resource
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from launcher.train.dist import all_reduce_sum
from launcher.train.straggler import ComputeTimer

# Dense peak FLOP/s per GPU for bf16/fp16 tensor cores (fp32 runs with train.tf32 use TF32, about half), by the
# model in torch.cuda.get_device_name as a whole word, first match first: an A10G is not an A10, nor a GH200 an
# H200, and a GPU not listed has no MFU rather than another one's peak
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H800 PCIe", 756e12),
              ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
              ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12),
              ("A10", 125e12), ("L4", 121e12), ("V100", 125e12), ("4090", 165e12))


def peak_flops(device: torch.device, precision: str, tf32: bool = True) -> float | None:
    """The GPU's peak for this precision, or None where it is unknown (not invented): every CPU, fp32 without
    TF32 (7-15x under the TF32 peak, by GPU), and bf16/fp32 before Ampere (V100: no bf16 or TF32 tensor cores)."""
    if device.type != "cuda" or (precision == "fp32" and not tf32):
        return None
    if precision != "fp16" and torch.cuda.get_device_capability(device) < (8, 0):
        return None
    peak = peak_of_gpu(torch.cuda.get_device_name(device))
    return None if peak is None else peak / (2 if precision == "fp32" else 1)


def peak_of_gpu(name: str) -> float | None:
    """`NVIDIA H100 80GB HBM3` -> its dense bf16/fp16 peak FLOP/s; None for a GPU not in PEAK_FLOPS, and for a MIG
    slice (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`: a share of the GPU's compute, which its name does not say exactly)."""
    if re.search(r"\bMIG\b", name):
        return None
    return next((peak for model, peak in PEAK_FLOPS if re.search(rf"\b{re.escape(model)}\b", name)), None)


def training_flops_per_item(model: torch.nn.Module) -> float:
    """6 x non-embedding parameters: forward + backward FLOPs per token (or per sample without tokens)."""
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    return 6.0 * (sum(p.numel() for p in model.parameters()) - embedding)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS; Linux reports KiB


class Meter:
    def __init__(self, device: torch.device, flops_per_item: float, peak: float | None, rank: int, world_size: int,
                 sharded: bool = False):
        self.device, self.flops_per_item, self.peak, self.world_size = device, flops_per_item, peak, world_size
        self.loss = torch.zeros((), device=device)
        self.timer = ComputeTimer(device, rank, world_size, sharded)  # the step starts and stops it
        self.reset()

    def reset(self) -> None:
        self.steps = self.samples = 0
        self.data_wait_s = self.left_out_s = 0.0
        self.ckpt_wait_s = 0.0  # the training thread's time in saves (the loop adds it): a save's cost to the steps
        self.started = time.perf_counter()
        self.loss.zero_()
        self.tokens: int | None = None  # this rank's, counted on the CPU (text jobs only)

    def add(self, samples: int, loss: torch.Tensor, tokens: int | None, data_wait_s: float) -> None:
        self.steps += 1
        self.samples += samples
        self.data_wait_s += data_wait_s
        self.loss += loss
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens

    @contextmanager
    def left_out(self) -> Iterator[None]:
        """Time that is not training (an eval, a checkpoint): the interval's rates leave it out."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.left_out_s += time.perf_counter() - began

    def read(self) -> dict[str, Any]:
        """The interval's means and rates; every rank calls it (tokens are summed over ranks)."""
        elapsed = time.perf_counter() - self.started - self.left_out_s
        record: dict[str, Any] = {"loss": (self.loss / max(self.steps, 1)).item(),
                                  "samples_per_sec": self.samples / elapsed}
        items_per_sec = record["samples_per_sec"]
        if self.tokens is not None:
            tokens = all_reduce_sum(torch.full((), float(self.tokens), dtype=torch.float64, device=self.device))
            record["tokens_per_sec"] = tokens.item() / elapsed
            items_per_sec = record["tokens_per_sec"]
        record["mfu"] = None if self.peak is None else \
            self.flops_per_item * items_per_sec / (self.peak * self.world_size)
        record["data_wait_frac"] = self.data_wait_s / elapsed
        record["ckpt_wait_s"] = self.ckpt_wait_s
        record["peak_mem_mb"] = peak_memory_mb(self.device)
        record.update(self.timer.read())
        self.reset()
        return record
