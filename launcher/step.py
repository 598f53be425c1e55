"""One optimizer step over K micro-batches: the distributed math the tests prove.

Exercised by: tests/test_distributed_math.py (real torchrun + gloo) and `python -m launcher +exp=toy`.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.data import Window
from launcher.dist import all_reduce_sum
from launcher.precision import Precision
from launcher.task import Task, count_tokens, to_device


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over every item of the step on all ranks (on the device)
    grad_norm: torch.Tensor  # norm of the synchronized, unscaled gradients before clipping
    stepped: bool  # False when any rank saw a non-finite gradient: the step was skipped everywhere
    stop: bool  # some rank was asked to stop (preemption): all ranks stop after this step
    tokens: torch.Tensor | None  # non-pad tokens this rank processed (text jobs)


def train_step(model: DDP, task: Task, window: Window, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
               precision: Precision, max_grad_norm: float | None, device: torch.device,
               stop_requested: bool = False) -> StepResult:
    batches = [to_device(b, device) for b in window.micro_batches]
    weight = 0.0 if window.padding else 1.0
    world_size = torch.distributed.get_world_size()

    # Normalise by the items of the whole step on all ranks, not by K: a short last window and uneven
    # token counts then give the gradient of one big batch. One small all-reduce per step.
    n_items = all_reduce_sum(sum(task.count_items(b) for b in batches).float().to(device) * weight).clamp(min=1)
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        is_last = i == len(batches) - 1
        # Forward AND backward outside the sync: DDP all-reduces only on the last micro-batch's backward.
        with nullcontext() if is_last else model.no_sync():
            with precision.autocast():
                batch_loss = task.loss_sum(model, batch) * weight
            # DDP averages over ranks; x world_size / n_items turns that into the mean over all items
            scaler.scale(batch_loss * (world_size / n_items)).backward()
        loss_sum += batch_loss.detach().float()

    scaler.unscale_(optimizer)  # once per step: clip true gradients, not scaled ones
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
    if max_grad_norm:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_grad_norm, grad_norm)
    # One all-reduce: every rank learns whether any rank saw inf/nan (so all skip together), whether any
    # rank was asked to stop (so all stop at this step boundary), and the step's loss.
    stats = all_reduce_sum(torch.stack([(~torch.isfinite(grad_norm)).float(), loss_sum,
                                        torch.tensor(float(stop_requested), device=device)]))
    nonfinite, _, stop = stats.tolist()  # the step's one host sync
    stepped = nonfinite == 0
    if stepped:
        optimizer.step()
    scaler.update()  # fp16: halves the scale after a skip (same on all ranks); no-op otherwise
    if stepped:  # the schedule counts real updates only (Lightning#18828)
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = [count_tokens(b) for b in batches]
    return StepResult(loss=stats[1] / n_items, grad_norm=grad_norm, stepped=stepped, stop=stop > 0,
                      tokens=None if tokens[0] is None else sum(tokens) * weight)
