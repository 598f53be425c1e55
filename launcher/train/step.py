"""One optimizer step over K micro-batches: the distributed math the tests prove.

The step never waits for the GPU: counts come from the CPU batches, flags are agreed on the device and
read by the host one step late (launcher/train/ledger.py), and a fused optimizer skips a non-finite step on
the device. Exercised by: tests/test_distributed_math.py (real torchrun + gloo), tests/test_gpu.py
(CUDA, sync debug mode) and `python -m launcher +exp=toy`.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.task import Task, to_device
from launcher.train.data import Window
from launcher.train.dist import all_reduce_sum
from launcher.train.ledger import StepLedger
from launcher.train.precision import Precision
from launcher.train.straggler import ComputeTimer


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over every item of the step on all ranks (on the device)
    grad_norm: torch.Tensor  # norm of the synchronized, unscaled gradients before clipping (on the device)


def train_step(model: DDP, task: Task, window: Window, optimizer: torch.optim.Optimizer, ledger: StepLedger,
               scaler: torch.amp.GradScaler, precision: Precision, max_grad_norm: float | None,
               device: torch.device, timer: ComputeTimer, stop_requested: bool = False) -> StepResult:
    batches = [to_device(b, device) for b in window.micro_batches]
    weight = 0.0 if window.padding else 1.0
    world_size = torch.distributed.get_world_size()

    # Normalise by the items of the whole step on all ranks, not by K: a short last window and uneven
    # token counts then give the gradient of one big batch. One small all-reduce per step.
    n_items = all_reduce_sum(torch.full((), float(window.n_items), device=device)).clamp(min=1)
    loss_sum = torch.zeros((), device=device)
    timer.start()  # this rank's compute before it waits for the others (straggler metric)
    for i, batch in enumerate(batches):
        is_last = i == len(batches) - 1
        # Forward AND backward outside the sync: DDP all-reduces only on the last micro-batch's backward.
        with nullcontext() if is_last else model.no_sync():
            with precision.autocast():
                batch_loss = task.loss_sum(model, batch) * weight
            if is_last:
                timer.stop()  # the last backward waits for every rank's gradients
            # DDP averages over ranks; x world_size / n_items turns that into the mean over all items
            scaler.scale(batch_loss * (world_size / n_items)).backward()
        loss_sum += batch_loss.detach().float()

    scaler.unscale_(optimizer)  # once per step: clip true gradients, not scaled ones
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
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


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """optimizer.step(), skipped when `nonfinite`: on the device for fused optimizers (they take found_inf
    the way GradScaler hands it over, and undo their step count), else by one read of the flag (free on
    the CPU; a host sync on a GPU, which is why fused optimizers are the default there).

    Not before the optimizer has state: a fused SGD creates its momentum buffers with empty_like in its
    first step and keeps them even when found_inf skips the update, so a skipped first step would leave
    garbage momentum behind. The first step (and any before a real one) reads the flag instead."""
    if getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.state:
        optimizer.grad_scale, optimizer.found_inf = None, nonfinite.float()  # grads are unscaled already
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not nonfinite.item():
        optimizer.step()
