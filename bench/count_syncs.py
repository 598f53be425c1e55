"""Counts gradient all-reduces per optimizer step of the launcher's own train step on the bench workload:
builds the run exactly as launcher.train.worker does, wraps DDP's all-reduce in a counting comm hook and
notes the micro-batch each call ran in (one sync round = calls in one micro-batch's backward).
Run: torchrun --standalone --nproc-per-node 2 bench/count_syncs.py <config.yaml> <steps>
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from launcher.train import dist as launcher_dist
from launcher.train.data import StepWindows
from launcher.train.ledger import Progress
from launcher.train.loop import step_ledger
from launcher.train.step import train_step
from launcher.train.straggler import ComputeTimer
from launcher.train.worker import build


def main(config_path: str, steps: int) -> None:
    cfg = OmegaConf.load(config_path)
    env = launcher_dist.init(cfg.plan.device_type, cfg.dist.backend, cfg.dist.timeout_s)
    result = count(cfg, env, config_path, steps)  # the run and its DDP model end with this call
    if env.is_main:
        print(json.dumps(result), flush=True)
    launcher_dist.shutdown()


def count(cfg: DictConfig, env: launcher_dist.DistEnv, config_path: str, steps: int) -> dict:
    """All-reduce calls per step (one per DDP bucket) and the micro-batches they ran in, after step 1
    (DDP rebuilds its buckets in grad-ready order after the first step)."""
    run = build(cfg, Path(config_path).parent, env)
    micro_batch, calls_at = [0], []

    def counting_hook(state, bucket):  # unannotated: DDP checks annotations
        calls_at.append(micro_batch[0])
        return allreduce_hook(None, bucket)

    def counted_loss_sum(model, batch, loss_sum=run.task.loss_sum):
        micro_batch[0] += 1
        return loss_sum(model, batch)

    run.model.register_comm_hook(None, counting_hook)
    run.task.loss_sum = counted_loss_sum
    windows = StepWindows(run.task, run.data_plan, env.rank, env.world_size, run.grad_accum_steps)
    ledger = step_ledger(run, Progress())
    for step in range(steps):
        if step == 1:
            calls_at.clear()
        train_step(run.model, run.task, windows[step], run.optimizer, ledger, run.scaler, run.precision,
                   run.max_grad_norm, env.device, ComputeTimer(env.device, env.rank, env.world_size), run.out_of_memory)
    last_micro_batches = {k * run.grad_accum_steps for k in range(2, steps + 1)}
    return {"hook_calls_per_step": len(calls_at) / (steps - 1),
            "sync_rounds_per_step": len(set(calls_at)) / (steps - 1),
            "only_in_last_micro_batch": set(calls_at) <= last_micro_batches}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
