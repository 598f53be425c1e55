"""train.micro_batch_size=auto under strategy=fsdp: every rank tries the same sizes together, and running out of
memory ends the run for a start with half the size.

FSDP2's forward and backward gather each block's weights from every rank, so a rank that ran out of memory inside
one would leave the others waiting in the gather: no trial or step can be dropped and redone as under DDP
(launcher/train/micro_batch.py). On a GPU two small trials' peaks, extrapolated, name the first size to try, so
that a trial rarely runs out at all; one that does exits (micro_batch.exit_out_of_memory), naming half its size
for the next start. Exercised by: tests/test_micro_batch.py (the fsdp tests) and tests/test_gpu.py (fsdp on a GPU).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from launcher.train.dist import all_gather_objects
from launcher.train.memory_trial import forward_backward, moments_to_come, usable_bytes
from launcher.train.sharding import state_bytes

if TYPE_CHECKING:
    from launcher.train.run import Run

GiB = 2**30


def held_later(run: Run, share: int) -> Callable[[int], int]:
    """Bytes a trial does not hold but a step at a size will: the optimizer's state (memory_trial.moments_to_come),
    and, when a step accumulates over several micro-batches, the gradients kept between them: FSDP2's unsharded
    ones, every weight's, in float32 under bf16/fp16 (FSDP2 accumulates in the reduce dtype,
    launcher/train/sharding.py), else in the weight's dtype; with strategy.reduce_every_micro_batch this rank's
    shards of them, in the weights' dtype (under hybrid sharding FSDP2 keeps them, partly reduced, in the reduce
    dtype until the last micro-batch's all-reduce: float32, as the shards of float32 weights)."""
    mixed = run.precision.autocast_dtype is not None
    held = (state_bytes(run.module, run.optimizer)["grads"] if run.reduce_every_micro_batch else
            sum(p.numel() * (4 if mixed else p.element_size())  # a DTensor's numel is the whole tensor's
                for p in run.module.parameters() if p.requires_grad))
    state = moments_to_come(run)
    return lambda size: state + (held if share // size > 1 else 0)


def first_to_try(sizes: list[int], peaks: dict[int, int], later: Callable[[int], int], usable: float) -> int:
    """The largest of `sizes` (largest first) whose peak, on the line through the two `peaks` measured at small
    sizes (activations grow with the batch; the gathered weights and the shards do not), plus `later`'s bytes,
    fits in `usable`; else the smallest."""
    (small, low), (large, high) = sorted(peaks.items())
    per_sample = max(high - low, 0) / (large - small)
    return next((size for size in sizes if low + (size - small) * per_sample + later(size) <= usable), sizes[-1])


def probe_in_step(run: Run, sizes: list[int], smaller: str) -> tuple[int, str]:
    """Every rank: the largest of `sizes` that fits on every rank, and what the trials found. Each trial reduces
    its gradients as a step's last micro-batch does (as every micro-batch does with strategy.reduce_every_micro_batch;
    every rank is in it; the gradients land in the shards and
    zero_grad drops them). A size that does not fit by measurement moves every rank to the next smaller one;
    running out of memory raises, for micro_batch.exit_out_of_memory."""
    device, share = run.env.device, run.data_plan.global_batch_size // run.env.world_size
    later, tried, start = held_later(run, share), [], sizes[0]  # a CPU does not count memory: the largest runs
    if device.type == "cuda" and len(sizes) > 1:
        peaks = {}
        # Each size twice, the second peak kept: a first trial's one-off memory (lazy init; under train.compile the
        # graph a new shape compiles, and its autotuning) is no sample's. run.micro_batch_size is what
        # exit_out_of_memory halves if a trial runs out.
        for size in [*reversed(sizes[-2:])] * 2:
            run.micro_batch_size = size
            peaks[size] = forward_backward(run, size, gradient_sync=True)
        choices = all_gather_objects((first_to_try(sizes, peaks, later, usable_bytes(device)), sorted(peaks.items())))
        start = min(first for first, _ in choices)
        tried.append(" and ".join(str(size) for size, _ in sorted(peaks.items())) + " to extrapolate: " + "; ".join(
            f"rank {r}'s peaks {', '.join(f'{peak / GiB:.2f}' for _, peak in theirs)} GiB point to {first}"
            for r, (first, theirs) in enumerate(choices)))
    for size in sizes[sizes.index(start):]:
        run.micro_batch_size = size
        usable = usable_bytes(device) if device.type == "cuda" else 0.0
        peak = forward_backward(run, size, gradient_sync=True)
        need = None if peak is None else peak + later(size)
        found = all_gather_objects(None if need is None or need <= usable else
                                   f"needs {need / GiB:.1f} GiB of {usable / GiB:.1f} GiB usable")
        tried.append(f"{size} " + ("does not: " + "; ".join(f"rank {r} {why}" for r, why in enumerate(found) if why)
                                   if any(found) else "fits on every rank"))
        if not any(found):
            return size, "tried " + ", then ".join(tried)
    raise RuntimeError(f"train.micro_batch_size=auto: even micro-batch 1 of the job's largest batch does not fit "
                       f"on every rank (tried {', then '.join(tried)}); {smaller}")
