"""Issue 40's numbers: strategy=fsdp against strategy=ddp on the same workload, interleaved A B A B.

+exp=bench (BERT 4 x 256, seq 128, random tokens, micro-batch 8, accumulation 4, AdamW, clipping 1.0) on 2 ranks
(gloo on the CPU; on a GPU machine --gpu: BERT-base on one GPU, bf16, eager and compiled); fsdp also with
strategy.reduce_every_micro_batch (the gradients stay sharded between micro-batches). Per row and round:
seconds per optimizer step (median over log intervals after the first), peak memory of rank 0 (RSS on the CPU,
allocated on a GPU), and the state each rank keeps (summary.json's state_bytes_per_rank: weights, gradients,
optimizer). On one GPU fsdp shards over a world of 1: the numbers there are its overhead against ddp, not its
saving.
Run: python bench/fsdp.py [--rounds 2] [--gpu] --out bench/RESULTS-FSDP.md
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
CPU = ("+exp=bench", "launcher.device=cpu", "launcher.nproc_per_node=2", "train.max_steps=20", "train.log_every=2",
       "train.eval_every=0")
GPU = ("+exp=bench", "launcher.device=cuda", "launcher.nproc_per_node=1", "model.layers=12", "model.hidden=768",
       "model.heads=12", "train.global_batch_size=512", "train.micro_batch_size=128", "precision=bf16",
       "train.max_steps=40", "train.log_every=5", "train.eval_every=0")
# what each row runs (with --gpu also compiled: one graph for ddp, each block for fsdp)
EAGER = {"ddp": ("strategy=ddp", "train.compile=false"), "fsdp": ("strategy=fsdp", "train.compile=false"),
         "fsdp, reduce every micro-batch": ("strategy=fsdp", "train.compile=false",
                                            "strategy.reduce_every_micro_batch=true")}
COMPILED = {"ddp, compiled": ("strategy=ddp", "train.compile=true"),
            "fsdp, compiled per block": ("strategy=fsdp", "train.compile=true")}


def run(run_dir: Path, common: tuple[str, ...], variant: tuple[str, ...]) -> dict:
    out = subprocess.run([sys.executable, "-m", "launcher", *common, *variant, f"hydra.run.dir={run_dir}"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stdout[-2000:] + out.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    batch = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["global_batch_size"]
    return {"s_per_step": statistics.median(batch / r["samples_per_sec"] for r in steps[1:]),
            "peak_mb": summary["peak_mem_mb"], "state": summary["state_bytes_per_rank"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    common = GPU if args.gpu else CPU
    variants = {**EAGER, **(COMPILED if args.gpu else {})}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for i, (name, variant) in enumerate(variants.items()):
                results[name].append(run(Path(tmp) / f"{i}-{round_}", common, variant))
                print(name, round_, results[name][-1], flush=True)  # a call cut off at its limit keeps what ran
    device = torch.cuda.get_device_name() if args.gpu else f"{platform.machine()}, cpu, {torch.get_num_threads()} threads"
    lines = [f"# strategy=fsdp against strategy=ddp ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {device}; torch {torch.__version__}; `{' '.join(common)}`; {args.rounds} interleaved rounds.", "",
             "| strategy | s/step (median; per round) | peak memory rank 0 (MB) | weights / gradients / optimizer per rank "
             "(MB) | state vs ddp |", "|---|---|---|---|---|"]
    whole = sum(results["ddp"][0]["state"].values())
    for strategy, rounds in results.items():
        state = rounds[0]["state"]
        times = [r["s_per_step"] for r in rounds]
        lines.append(f"| {strategy} | {statistics.median(times):.3f}; {', '.join(f'{t:.3f}' for t in times)} | "
                     f"{statistics.median(r['peak_mb'] for r in rounds):.0f} | "
                     f"{state['params'] / 2**20:.1f} / {state['grads'] / 2**20:.1f} / {state['optimizer'] / 2**20:.1f} | "
                     f"{sum(state.values()) / whole:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
