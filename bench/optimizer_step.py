"""AdamW's step on the bench BERT's parameters: the per-tensor loop (torch's default on the CPU), foreach
(its default on CUDA) and fused (the launcher's default on every device): the measurement behind the fused
default on the CPU (launcher/train/worker.py).
Run: python bench/optimizer_step.py [--layers 4 --hidden 256] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jobs.bench import bert_from_config  # noqa: E402


def seconds_per_step(params: list[torch.nn.Parameter], kind: str, steps: int) -> float:
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=kind == "fused" or None,
                                  foreach={"loop": False, "foreach": True}.get(kind))
    optimizer.step()  # the state is created in the first step
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.step()
        if params[0].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = bert_from_config(args.layers, args.hidden, args.heads).to(device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    loop, foreach, fused = (seconds_per_step(params, kind, args.steps) for kind in ("loop", "foreach", "fused"))
    print(f"AdamW step, BERT {args.layers} x {args.hidden} ({sum(p.numel() for p in params) / 1e6:.1f} M "
          f"parameters), {device.type}, torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
          f"{args.steps}: per-tensor loop {loop * 1e3:.1f} ms, foreach {foreach * 1e3:.1f} ms, fused "
          f"{fused * 1e3:.1f} ms (fused {loop / fused:.2f}x and {foreach / fused:.2f}x faster)")


if __name__ == "__main__":
    main()
