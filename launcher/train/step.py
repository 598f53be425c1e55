"""One optimizer step over K micro-batches: the distributed math the tests prove.

The step never waits for the GPU: counts come from the CPU batches, flags are agreed on the device and
read by the host one step late (launcher/train/ledger.py), and a fused optimizer skips a non-finite step on
the device. With train.micro_batch_size=auto the ranks also agree, on the host, whether any ran out of
memory before the gradient all-reduce (launcher/train/micro_batch.py). Exercised by:
tests/test_distributed_math.py (real torchrun + gloo), tests/test_micro_batch.py, tests/test_gpu.py (CUDA,
sync debug mode), tests/test_fsdp.py, tests/test_fsdp_accumulation.py, tests/test_hybrid_sharding.py and
`python -m launcher +exp=toy`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.task import Task, to_device
from launcher.train import sharding
from launcher.train.data import Window
from launcher.train.dist import all_reduce_sum
from launcher.train.ledger import StepLedger
from launcher.train.memory_trial import out_of_memory_in
from launcher.train.micro_batch import OutOfMemoryAgreement
from launcher.train.precision import Precision
from launcher.train.straggler import ComputeTimer


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over every item of the step on all ranks (on the device)
    grad_norm: torch.Tensor  # norm of the synchronized, unscaled gradients before clipping (on the device)


def train_step(model: DDP | torch.nn.Module, task: Task, window: Window, optimizer: torch.optim.Optimizer,
               ledger: StepLedger, scaler: torch.amp.GradScaler, precision: Precision, max_grad_norm: float | None,
               device: torch.device, timer: ComputeTimer, out_of_memory: OutOfMemoryAgreement,
               stop_requested: bool = False, reduce_every_micro_batch: bool = False) -> StepResult | None:
    """One optimizer step; None when a rank ran out of memory before the gradient all-reduce (with
    train.micro_batch_size=auto): then nothing changed, and every rank redoes the step in smaller pieces.
    `reduce_every_micro_batch` (strategy=fsdp only): every backward reduce-scatters its gradients."""
    # 0 for a rank without samples in a short window, and for repeated micro-batches (strategy=fsdp)
    n = len(window.micro_batches)
    weights = [0.0 if window.padding or i >= n - window.repeats else 1.0 for i in range(n)]
    world_size = torch.distributed.get_world_size()

    # Normalise by the items of the whole step on all ranks, not by K: a short last window and uneven
    # token counts then give the gradient of one big batch. One small all-reduce per step.
    n_items = all_reduce_sum(torch.full((), float(window.n_items), device=device)).clamp(min=1)
    # DDP (and FSDP) average over ranks; x world_size / n_items turns that into the mean over all items
    scale = world_size / n_items
    timer.start()  # this rank's compute before it waits for the others (straggler metric)
    try:
        last_loss, loss_sum = forward_until_sync(model, task, window.micro_batches, weights, scale, scaler, precision,
                                                 reduce_every_micro_batch)
    except Exception as error:  # running out, also where torch.compile compiles the first step (memory_trial.py)
        if not (out_of_memory.redoes and out_of_memory_in(error)):  # a fixed size, or strategy=fsdp: the worker
            raise  # exits (micro_batch.exit_out_of_memory); any other error is no business of this step
        last_loss = None  # the traceback, and the activations its frames hold, go with this block
    timer.stop()  # the last backward waits for every rank's gradients
    if out_of_memory.any_rank_ran_out(last_loss is None):  # agreed before the step's one gradient all-reduce
        timer.drop_last()
        return None  # every rank drops the step (micro_batch.shrink) and redoes it in smaller micro-batches
    scaler.scale(last_loss * scale).backward()  # DDP all-reduces (FSDP reduce-scatters) the gradients here, once
    loss_sum += last_loss.detach().float()

    scaler.unscale_(optimizer)  # once per step: clip true gradients, not scaled ones
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = sharding.total_norm(grads, device)  # over every rank's shards with strategy=fsdp
    if max_grad_norm:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_grad_norm, grad_norm)
    # One all-reduce: every rank learns whether any rank saw inf/nan (so all skip together), whether any
    # rank was asked to stop (so all stop at the same step), and the step's loss.
    nonfinite, loss_sum, stop = all_reduce_sum(torch.stack([
        (~torch.isfinite(grad_norm)).float(), loss_sum, torch.full((), float(stop_requested), device=device)]))
    ledger.settle()  # the previous step's flags, long computed: its scheduler step comes before this update
    step_unless_nonfinite(optimizer, nonfinite > 0)
    scaler.update()  # fp16: halves the scale after a skip (same on all ranks); no-op otherwise
    optimizer.zero_grad(set_to_none=True)
    ledger.record(nonfinite, stop)
    return StepResult(loss=loss_sum / n_items, grad_norm=grad_norm)


def forward_until_sync(model: DDP | torch.nn.Module, task: Task, cpu_batches: list[dict], weights: list[float],
                       scale: torch.Tensor, scaler: torch.amp.GradScaler, precision: Precision,
                       reduce_every_micro_batch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything of the step before its gradient reduction: forward AND backward of micro-batches 1..K-1
    without a gradient sync (DDP all-reduces, FSDP reduce-scatters, only in the last backward), then the last
    micro-batch's forward. Under DDP that enters no collective. strategy=fsdp gathers weights in every forward and
    backward, and with `reduce_every_micro_batch` each backward also reduce-scatters into the shards, where the
    gradients accumulate: 1/world (1/shard_size) of the memory whole gradients take between micro-batches, for K
    reduce-scatters a step instead of one (under hybrid sharding the all-reduce across the replicas still waits for
    the last).
    Each micro-batch goes to the device here, where running out of memory can still be redone (a nearly full
    GPU may fail the copy as well as the forward). Returns the last micro-batch's loss and the others' summed
    loss."""
    device = scale.device
    loss_sum = torch.zeros((), device=device)
    for batch, weight in zip(cpu_batches[:-1], weights):
        with sharding.no_gradient_sync(model, reduce_scatter=reduce_every_micro_batch):
            with precision.autocast():
                batch_loss = task.loss_sum(model, to_device(batch, device)) * weight
            scaler.scale(batch_loss * scale).backward()
        loss_sum += batch_loss.detach().float()
    with precision.autocast():
        return task.loss_sum(model, to_device(cpu_batches[-1], device)) * weights[-1], loss_sum


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """optimizer.step(), skipped when `nonfinite`: on the device for fused optimizers (they take found_inf
    the way GradScaler hands it over, and undo their step count), else by one read of the flag (free on
    the CPU; a host sync on a GPU, which is why fused optimizers are the default).

    Not before the optimizer has state: a fused SGD creates its momentum buffers with empty_like in its
    first step and keeps them even when found_inf skips the update, so a skipped first step would leave
    garbage momentum behind. The first step (and any before a real one) reads the flag instead, unless
    the optimizer never keeps state (SGD without momentum)."""
    stateless = isinstance(optimizer, torch.optim.SGD) and not any(g["momentum"] for g in optimizer.param_groups)
    if getattr(optimizer, "_step_supports_amp_scaling", False) and (optimizer.state or stateless):
        optimizer.grad_scale, optimizer.found_inf = None, nonfinite.float()  # grads are unscaled already
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not nonfinite.item():
        optimizer.step()
