"""A minimal hand-written torchrun + DDP loop: the baseline that bench/compare.py measures the launcher
against. Same model and data as `+exp=bench` (jobs/bench.py); micro-batches 1..K-1 under no_sync,
autocast for bf16/fp16 (GradScaler for fp16), clipping, fused AdamW (as the launcher's default). On CUDA:
NCCL, one GPU per rank, TF32, pinned batches copied with non_blocking, optionally torch.compile; gloo on the CPU.
Run: torchrun --standalone --nproc-per-node 2 bench/raw_ddp.py [--precision bf16] [--compile [--compile-mode M]]
For finding out why compile pays or not on a GPU: --compile-outer compiles DDP itself (torch.compile(DDP(m)))
instead of the module DDP wraps, as the launcher does; either way dynamo's DDPOptimizer splits the graph
at DDP's buckets (BERT-base: 14 graphs) so that the all-reduce overlaps the backward, and --no-ddp-split
compiles one graph (torch._dynamo.config.optimize_ddp=False: one rank has no all-reduce to overlap);
--profile FILE runs two more steps after the timed ones under torch.profiler and writes their op table (the
most device time first) and their trace (FILE with suffix .json, steps marked as the launcher's train.profile
marks them: bench/trace_summary.py gives the time per step on host and GPU, for both).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
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

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=list(DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode (with --compile)")
    parser.add_argument("--compile-outer", action="store_true", help="torch.compile(DDP(module)), with --compile")
    parser.add_argument("--no-ddp-split", action="store_true", help="one graph, not one per DDP bucket")
    parser.add_argument("--profile", type=Path, default=None, help="op table of two profiled steps after the timed ones")
    parser.add_argument("--count-syncs", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = bert_from_config(args.layers, args.hidden, args.heads, max_length=args.seq_len).to(device)
    device_ids = [device.index] if cuda else None
    torch._dynamo.config.optimize_ddp = not args.no_ddp_split
    if args.compile and args.compile_outer:
        model = torch.compile(DDP(module, device_ids=device_ids), mode=args.compile_mode)
    else:
        model = DDP(torch.compile(module, mode=args.compile_mode) if args.compile else module, device_ids=device_ids)
    per_rank = args.micro * args.accum
    data = RandomTokens(n_samples=max(4096, 2 * per_rank * world), seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    dtype = DTYPES[args.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    syncs = [0]
    if args.count_syncs:
        def counting_hook(state, bucket):  # unannotated: DDP checks annotations
            syncs[0] += 1
            return allreduce_hook(None, bucket)
        model.register_comm_hook(None, counting_hook)
    order = torch.Generator().manual_seed(0)

    def train_step() -> torch.Tensor:
        indices = torch.randperm(len(data.train_set), generator=order)[:per_rank * world]
        mine = indices[rank * per_rank:(rank + 1) * per_rank]
        if args.compile_mode in ("reduce-overhead", "max-autotune"):
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs: a new iteration
        for k in range(args.accum):
            batch = data.collate(mine[k * args.micro:(k + 1) * args.micro].tolist())
            if cuda:
                batch = {key: v.pin_memory().to(device, non_blocking=True) for key, v in batch.items()}
            with model.no_sync() if k < args.accum - 1 else nullcontext():
                with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = data.loss_sum(model, batch) / per_rank
                scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    stamps, first_step = [], None
    for step in range(args.steps):
        if step == 1:  # DDP rebuilds its buckets in grad-ready order after the first step: count from then on
            syncs[0] = 0
        loss = train_step()
        if first_step is None:
            loss.item()  # the first step has really run (the GPU caught up)
            first_step = time.time()
        if (step + 1) % args.log_every == 0:
            loss.item()  # waits for the GPU: the stamp is the end of this step
            stamps.append(time.time())
    if args.profile and rank == 0:
        profile(train_step, args.profile, cuda)
    elif args.profile:
        for _ in range(2):
            train_step()  # the other ranks' steps, for rank 0's collectives
    if rank == 0:
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"stamps": stamps, "first_step_unix_time": first_step, "syncs_per_step": syncs[0] / (args.steps - 1),
                          "peak_mem_mb": peak, "samples_per_step": per_rank * world,
                          "log_every": args.log_every}), flush=True)
    model = optimizer = None  # DDP must be collected while Python is alive (see launcher.train.dist.shutdown)
    gc.collect()
    dist.destroy_process_group()


def profile(train_step, out: Path, cuda: bool) -> None:
    """Two steps under torch.profiler: their ops, the most device time (host time on the CPU) first, into
    `out`; their Chrome trace into `out` with the suffix .json."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profiler(activities=activities, record_shapes=True) as prof:  # as the launcher's train.profile
        for step in range(2):
            with torch.profiler.record_function(f"step {step + 1}"):  # as the launcher marks its steps
                loss = train_step()
            loss.item()
    prof.export_chrome_trace(str(out.with_suffix(".json")))  # per step times: bench/trace_summary.py
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    out.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=60) + "\n")


if __name__ == "__main__":
    main()
