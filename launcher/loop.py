"""The training loop: a plain function with explicit cadences (log, eval), then the final save.

Exercised by: `python -m launcher +exp=toy`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher import checkpoint
from launcher.data import DataPlan, StepWindows, eval_batches, window_loader
from launcher.dist import DistEnv, all_reduce_sum
from launcher.metrics import RunLog
from launcher.precision import Precision
from launcher.step import train_step
from launcher.task import Task


@dataclass
class Run:
    """Everything the loop needs, built once by the worker."""

    run_dir: Path
    env: DistEnv
    task: Task
    model: DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    precision: Precision
    data_plan: DataPlan
    grad_accum_steps: int
    micro_batch_size: int
    max_steps: int
    max_grad_norm: float | None
    log_every: int
    eval_every: int
    num_workers: int
    log: RunLog
    config_hash: str


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Exact metrics: each rank sums over its disjoint share, one all-reduce adds the sums."""
    if run.task.eval_set is None:
        return {}
    module = run.model.module  # the bare module: DDP's forward could enter collectives unevenly here
    module.eval()
    keys = run.task.eval_sum_keys
    sums = torch.zeros(len(keys), dtype=torch.float64, device=run.env.device)
    for batch in eval_batches(run.task, run.env.rank, run.env.world_size, run.micro_batch_size):
        with run.precision.autocast():
            batch_sums = run.task.eval_sums(module, _on(batch, run.env.device))
        sums += torch.stack([batch_sums[k].double() for k in keys])
    all_reduce_sum(sums)
    module.train()
    return run.task.eval_metrics(dict(zip(keys, sums.tolist())))


def _on(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train(run: Run, start_step: int = 0) -> dict[str, Any]:
    """Train from start_step to max_steps; returns the summary (also written by rank 0)."""
    windows = StepWindows(run.task, run.data_plan, run.env.rank, run.env.world_size, run.grad_accum_steps)
    loader = window_loader(windows, range(start_step, run.max_steps), run.num_workers,
                           pin_memory=run.env.device.type == "cuda")
    started = last_log = time.perf_counter()
    samples = total_samples = skipped = interval_steps = 0
    interval_loss = torch.zeros((), device=run.env.device)
    tokens = torch.zeros((), device=run.env.device)
    step, loss, eval_metrics = start_step, float("nan"), {}
    for step, window in enumerate(loader, start=start_step + 1):  # step: optimizer steps done
        result = train_step(run.model, run.task, window, run.optimizer, run.scheduler, run.scaler,
                            run.precision, run.max_grad_norm, run.env.device)
        skipped += not result.stepped
        samples += window.step_samples
        interval_loss += result.loss
        interval_steps += 1
        if result.tokens is not None:
            tokens += result.tokens

        if step % run.log_every == 0 or step == run.max_steps:
            elapsed = time.perf_counter() - last_log
            loss = (interval_loss / interval_steps).item()  # mean over the steps since the last log
            record = {"step": step, "epoch": run.data_plan.epoch_of(step - 1), "loss": loss,
                      "lr": run.scheduler.get_last_lr()[0], "grad_norm": result.grad_norm.item(),
                      "samples_per_sec": samples / elapsed, "skipped_steps": skipped}
            if result.tokens is not None:  # every rank enters: the cadence is the same everywhere
                record["tokens_per_sec"] = all_reduce_sum(tokens).item() / elapsed
            if run.scaler.is_enabled():
                record["loss_scale"] = run.scaler.get_scale()
            run.log.metrics(record, run.max_steps)
            total_samples += samples
            samples, interval_steps, last_log = 0, 0, time.perf_counter()
            interval_loss.zero_()
            tokens.zero_()

        if run.eval_every and step % run.eval_every == 0 and step != run.max_steps:
            run.log.metrics({"step": step, "eval": evaluate(run)}, run.max_steps)

    eval_metrics = evaluate(run)
    if eval_metrics:
        run.log.metrics({"step": step, "eval": eval_metrics}, run.max_steps)
    wall = time.perf_counter() - started
    ckpt = checkpoint.save(run.run_dir, step, run.model.module, train_state(run, step), run.env.is_main)
    summary = {"steps": step, "final_loss": loss, "eval": eval_metrics, "wall_time_s": wall,
               "samples_per_sec": total_samples / wall if wall else 0.0, "world_size": run.env.world_size,
               "grad_accum_steps": run.grad_accum_steps, "precision": run.precision.name,
               "skipped_steps": skipped, "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
               "config_hash": run.config_hash, "checkpoint": str(ckpt)}
    run.log.summary(summary)
    return summary


def train_state(run: Run, step: int) -> dict[str, Any]:
    """Everything besides the weights that a resume needs."""
    return {"step": step, "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict()}
