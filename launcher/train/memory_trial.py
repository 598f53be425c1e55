"""One forward and backward of the job's largest batch of a size, and the GPU memory it took: the trials of
train.micro_batch_size=auto (launcher/train/micro_batch.py; sharded_micro_batch.py for strategy=fsdp), and what
running out is (out_of_memory_in: also inside torch.compile's errors, and a CUDA library's)."""
from __future__ import annotations

import gc
import re
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.exc import TorchDynamoException  # (DDP imports torch._dynamo too)

from launcher.task import Task, to_device
from launcher.train import sharding

if TYPE_CHECKING:
    from launcher.train.run import Run

HEADROOM = 0.10  # a trial leaves this share of the GPU free: fragmentation, longer batches, NCCL buffers


def memory_report(device: torch.device) -> str:
    """What this rank had, for the line that ends a run: the GPU's size and what this process holds."""
    if device.type != "cuda":
        return "CPU memory"
    free, total = torch.cuda.mem_get_info(device)
    return (f"{torch.cuda.get_device_name(device)}, {total / 2**30:.1f} GiB: {free / 2**30:.1f} GiB free, "
            f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB held by this rank")


def out_of_memory_in(error: BaseException) -> torch.OutOfMemoryError | None:
    """`error` if it is running out of memory, or the one inside torch.compile's error: inductor's autotuning
    (train.compile_mode=max-autotune) runs candidate kernels while it compiles, and dynamo raises what runs out
    there inside a BackendCompilerFailed (its inner_exception), which an except of OutOfMemoryError misses: with
    train.compile=true the run then ended as a failed compile where a smaller micro-batch would fit (under auto,
    dynamo's suppress_errors runs that code eagerly instead: compiled.EagerFallbacks). Only torch.compile's wrappers are
    looked into: an error of the launcher's raised from running out (every rank's copy of a checkpoint
    writer's error, launcher/train/dist.py) stays what it says."""
    for _ in range(8):  # (each wrapper holds the next: a few deep at most)
        if isinstance(error, torch.OutOfMemoryError):
            return error
        if library_ran_out(error):
            return torch.OutOfMemoryError(str(error).strip().splitlines()[0])
        if not isinstance(error, TorchDynamoException):
            return None
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


# A CUDA library that cannot get GPU memory: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
# `cublasCreate(handle)`", cuDNN's, cuSOLVER's, cuFFT's. Their handles are made at a thread's first call, with
# cudaMalloc outside torch's allocator, which cannot free its cache for them: the first backward (autograd's own
# thread) makes cuBLAS's at the probe's first trial, at its peak, where a size too large then ran out as this
# RuntimeError, and the run ended where a smaller micro-batch would fit. So too a cudaMalloc outside the allocator
# that fails as cudaErrorMemoryAllocation, which leaves the context usable: "CUDA error: out of memory" (torch's
# C10_CUDA_CHECK, an AcceleratorError from torch 2.8), "Triton Error [CUDA]: out of memory" (a kernel's first load).
LIBRARY_RAN_OUT = re.compile(r"^([A-Za-z]+ error: CU[A-Z]+_(STATUS_)?ALLOC_FAILED\b"  # (CUDA, cuDNN, cuFFT error)
                             r"|(CUDA error|Triton Error \[CUDA\]): out of memory\b)")


def library_ran_out(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and LIBRARY_RAN_OUT.match(str(error).strip()) is not None


def free_memory(device: torch.device) -> None:
    gc.collect()  # an out-of-memory traceback's frames may still hold the step's activations
    if device.type == "cuda":
        torch.cuda.empty_cache()


def usable_bytes(device: torch.device) -> float:
    """What a trial may take on this GPU: all but HEADROOM of what is free, and of what this process caches."""
    free_memory(device)
    return (1 - HEADROOM) * (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device))


def moments_to_come(run: Run) -> int:
    """Bytes the optimizer's state will take, made at its first step (after the trials): Adam's two tensors per
    trainable weight of this rank (its shards under fsdp; less for SGD), 0 once it has state (a resume)."""
    return 0 if run.optimizer.state else 2 * sharding.state_bytes(run.module, run.optimizer)["grads"]


def largest_batch(task: Task, size: int) -> dict[str, Any]:
    """`size` samples as large as the job's batches get: the job's own largest_batch (the longest
    sequences, for text), else the first samples (jobs whose samples all have one size)."""
    if hasattr(task, "largest_batch"):
        return task.largest_batch(size)
    return task.collate([task.train_set[i] for i in range(min(size, len(task.train_set)))])


def forward_backward(run: Run, size: int, gradient_sync: bool) -> int | None:
    """Forward and backward of the largest batch of `size`, its gradients dropped after: the GPU's peak bytes
    allocated meanwhile (None on a CPU, which does not count them). Running out of memory raises; the caller
    then drops the gradients (zero_grad) and frees the memory once the traceback is gone, as this does after a
    trial that fits: the next trial starts from a freed allocator."""
    device = run.env.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batch = to_device(largest_batch(run.task, size), device)
    with nullcontext() if gradient_sync else sharding.no_gradient_sync(run.model):
        with run.precision.autocast():
            loss = run.task.loss_sum(run.model, batch)
        loss.backward()
    del batch, loss  # the activations and the graph go before the next trial
    run.optimizer.zero_grad(set_to_none=True)
    free_memory(device)
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
