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
