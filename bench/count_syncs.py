"""Counts gradient all-reduces per optimizer step of the launcher's own train step on the bench workload:
builds the run exactly as launcher.worker does and wraps DDP's all-reduce in a counting comm hook.
Run: torchrun --standalone --nproc-per-node 2 bench/count_syncs.py <config.yaml> <steps>
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from launcher import dist as launcher_dist
from launcher.data import StepWindows
from launcher.step import train_step
from launcher.worker import build


def main(config_path: str, steps: int) -> None:
    cfg = OmegaConf.load(config_path)
    env = launcher_dist.init(cfg.dist.backend, cfg.dist.timeout_s)
    run = build(cfg, Path(config_path).parent, env)
    calls = [0]

    def counting_hook(state, bucket):  # unannotated: DDP checks annotations
        calls[0] += 1
        return allreduce_hook(None, bucket)

    run.model.register_comm_hook(None, counting_hook)
    windows = StepWindows(run.task, run.data_plan, env.rank, env.world_size, run.grad_accum_steps)
    for step in range(steps):
        train_step(run.model, run.task, windows[step], run.optimizer, run.scheduler, run.scaler, run.precision,
                   run.max_grad_norm, env.device)
    buckets = len(run.model._get_ddp_logging_data()["bucket_sizes"].split(","))
    if env.is_main:
        print(json.dumps({"hook_calls_per_step": calls[0] / steps, "buckets": buckets}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
