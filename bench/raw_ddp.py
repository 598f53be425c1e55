"""A minimal hand-written torchrun + DDP loop: the baseline that bench/compare.py measures the launcher
against. Same model and data as `+exp=bench` (jobs/bench.py); micro-batches 1..K-1 under no_sync,
autocast for bf16, clipping, AdamW. Run: torchrun --standalone --nproc-per-node 2 bench/raw_ddp.py
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jobs.bench import RandomTokens, bert_from_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--count-syncs", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(bert_from_config())
    data = RandomTokens()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    syncs = [0]
    if args.count_syncs:
        def counting_hook(state, bucket):  # unannotated: DDP checks annotations
            syncs[0] += 1
            return allreduce_hook(None, bucket)
        model.register_comm_hook(None, counting_hook)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    order = torch.Generator().manual_seed(0)
    per_rank = args.micro * args.accum
    stamps, first_step = [], None
    for step in range(args.steps):
        if step == 1:  # DDP rebuilds its buckets in grad-ready order after the first step: count from then on
            syncs[0] = 0
        indices = torch.randperm(len(data.train_set), generator=order)[:per_rank * world]
        mine = indices[rank * per_rank:(rank + 1) * per_rank]
        for k in range(args.accum):
            batch = data.collate(mine[k * args.micro:(k + 1) * args.micro].tolist())
            with model.no_sync() if k < args.accum - 1 else nullcontext():
                with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = data.loss_sum(model, batch) / per_rank
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first_step = first_step or time.time()
        if (step + 1) % args.log_every == 0:
            loss.item()
            stamps.append(time.time())
    if rank == 0:
        print(json.dumps({"stamps": stamps, "first_step_unix_time": first_step, "syncs_per_step": syncs[0] / (args.steps - 1),
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
    del model, optimizer  # DDP must be collected while Python is alive (see launcher.dist.shutdown)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
