"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to min_lr_ratio.

A LambdaLR, so its state is a step counter that checkpoints exactly. Exercised by: tests/test_units.py.
"""
from __future__ import annotations

import math

import torch


def lr_factor(step: int, name: str, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr after `step` real optimizer steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    decay = 1.0 - progress if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, max_steps: int,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, name, warmup_steps, max_steps, min_lr_ratio))


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict) -> None:
    """Continue at a checkpoint's position (its count of real steps) with this run's base lr and shape: a
    resume under a changed optimizer.lr or scheduler.* (resume.allow_config_change) follows the new config
    from its first step, and an unchanged one gets the very lr the checkpoint's run would have used."""
    scheduler.last_epoch, scheduler._step_count = saved["last_epoch"], saved["_step_count"]
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
