"""AdamW's step on the bench BERT's parameters, foreach (torch's default) vs fused (the launcher's default
on every device): the measurement behind the fused default on the CPU (launcher/train/worker.py).
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


def seconds_per_step(params: list[torch.nn.Parameter], fused: bool, steps: int) -> float:
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=fused, foreach=None if fused else True)
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
    foreach, fused = (seconds_per_step(params, f, args.steps) for f in (False, True))
    print(f"AdamW step, BERT {args.layers} x {args.hidden} ({sum(p.numel() for p in params) / 1e6:.1f} M "
          f"parameters), {device.type}, torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
          f"{args.steps}: foreach {foreach * 1e3:.1f} ms, fused {fused * 1e3:.1f} ms ({foreach / fused:.2f}x)")


if __name__ == "__main__":
    main()
