"""What model.activation_checkpointing buys and costs: the launcher's +exp=bench with and without it, interleaved.

Per round and setting: peak memory of the rank (GPU: max_memory_allocated; CPU: the process's peak RSS, which
also holds the weights, the optimizer state and Python) and seconds per optimizer step (median over the log
intervals after the first). With CUDA also the micro-batch that train.micro_batch_size=auto finds with each
setting (the larger micro-batch that fits is what checkpointing is for). One rank; fp32 on the CPU, bf16 on a GPU.
Run: python bench/activation_memory.py [--rounds 2] [--layers 12 --hidden 768 --heads 12 --micro 128]
(CPU defaults: BERT 6 x 512 at micro-batch 16, about 4 minutes on 2 cores; GPU: BERT-base at micro-batch 128)
Writes bench/RESULTS-ACTIVATION-MEMORY.md (--out).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from compare import REPO, run_launcher

SETTINGS = {"kept": "model.activation_checkpointing=false", "recomputed": "model.activation_checkpointing=true"}


def model_args(args: argparse.Namespace, cuda: bool) -> tuple[str, ...]:
    return (f"model.layers={args.layers}", f"model.hidden={args.hidden}", f"model.heads={args.heads}",
            f"data.seq_len={args.seq_len}", f"launcher.device={'cuda' if cuda else 'cpu'}", "launcher.nproc_per_node=1",
            "train.max_grad_norm=1.0")


def auto_micro_batch(setting: str, args: argparse.Namespace, work: Path) -> int:
    """The micro-batch train.micro_batch_size=auto picks for a global batch of --auto-share samples."""
    return run_launcher("bf16", work, steps=1, extra=(
        *model_args(args, True), SETTINGS[setting], "train.micro_batch_size=auto",
        f"train.global_batch_size={args.auto_share}", f"data.n_samples={args.auto_share}"))["micro_batch_size"]


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12 if cuda else 6)
    parser.add_argument("--hidden", type=int, default=768 if cuda else 512)
    parser.add_argument("--heads", type=int, default=12 if cuda else 8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=128 if cuda else 16)
    parser.add_argument("--steps", type=int, default=20 if cuda else 6)
    parser.add_argument("--auto-share", type=int, default=4096, help="GPU only: the global batch auto may fill")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS-ACTIVATION-MEMORY.md")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the step time is the median over log intervals after the first")
    precision = "bf16" if cuda else "fp32"
    fixed = (*model_args(args, cuda), f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro}",
             f"data.n_samples={max(4096, args.micro * args.steps)}")
    rows: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
            for setting in order:
                result = run_launcher(precision, Path(tmp), log_every=1, steps=args.steps,
                                      extra=(*fixed, SETTINGS[setting]))
                rows[setting].append(result)
                print(f"round {round_ + 1} {setting}: {result['step_s']:.3f} s/step, "
                      f"peak {result['peak_mem_mb']:.0f} MB", flush=True)
        auto = {setting: auto_micro_batch(setting, args, Path(tmp)) for setting in SETTINGS} if cuda else {}

    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    memory = "max_memory_allocated" if cuda else "peak RSS of the rank's process"
    lines = ["# Activation checkpointing: memory and step time\n",
             f"{device}; torch {torch.__version__}; `python bench/activation_memory.py --rounds {args.rounds}`: "
             f"+exp=bench (BERT {args.layers} x {args.hidden}, {args.heads} heads, seq {args.seq_len}), 1 rank, "
             f"{precision}, micro-batch {args.micro}, median s/step over steps 3-{args.steps} per round; peak memory: "
             f"{memory}.\n",
             "| model.activation_checkpointing | peak memory MB (per round) | s/step (per round) |", "|---|---|---|"]
    for setting, results in rows.items():
        memory_mb = ", ".join(f"{r['peak_mem_mb']:.0f}" for r in results)
        step_s = ", ".join(f"{r['step_s']:.3f}" for r in results)
        lines.append(f"| {SETTINGS[setting].split('=')[1]} | {memory_mb} | {step_s} |")
    kept, recomputed = rows["kept"], rows["recomputed"]
    memory_ratio = statistics.median(r["peak_mem_mb"] for r in recomputed) / statistics.median(r["peak_mem_mb"] for r in kept)
    time_ratio = statistics.median(b["step_s"] / a["step_s"] for a, b in zip(kept, recomputed))
    lines.append(f"\nWith checkpointing: peak memory x{memory_ratio:.2f}, step time x{time_ratio:.2f} (median per round).")
    if auto:
        capped = " (the whole share: a larger --auto-share may find more)" if auto["recomputed"] == args.auto_share else ""
        lines.append(f"train.micro_batch_size=auto (global batch {args.auto_share}): micro-batch {auto['kept']} without, "
                     f"{auto['recomputed']} with{capped}.")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
