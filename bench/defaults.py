"""Issue 37's GPU numbers: the launcher with no speed flags against the hand-written loop, on one GPU, BERT-base.

In one machine session, one after the other (each row's runs side by side):
1. the loop in bf16 eager, then the launcher with nothing but the workload (precision=auto, train.compile=auto,
   a fresh run dir: its compile cache is cold), stopped with Ctrl-C after step `--stop-at`, then the same command
   again: the restart resumes and loads its compiled kernels from the run dir (time to its first step);
2. the loop compiled as a user writes it (torch.compile, then DDP: dynamo's split at DDP's buckets);
3. eager at each precision on both sides (train.compile=false precision=X; the loop's eager X).
Writes a markdown table to --out (after every row) and prints it.
Run (GPU): python bench/defaults.py --out bench/RESULTS-DEFAULTS.md
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from compare import REPO, launch, run_raw
from gpu import BERT_BASE, mfu

ROW = "| {what} | {launcher} | {raw} | {ratio} | {mfu} | {first} | {note} |"


def launcher_run(run_dir: Path, args: argparse.Namespace, *overrides: str, stop_at: int | None = None) -> dict:
    """The launcher on the workload; with stop_at, Ctrl-C once that step is logged (a checkpoint, exit 75)."""
    workload = (f"model.layers={BERT_BASE['layers']}", f"model.hidden={BERT_BASE['hidden']}",
                f"model.heads={BERT_BASE['heads']}", f"data.seq_len={BERT_BASE['seq_len']}", "data.n_samples=8192",
                f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro * args.accum}",
                f"train.max_steps={args.steps}", f"train.log_every={args.log_every}")
    result = launch([*workload, *overrides], run_dir, stop_at)
    result["first_line"] = next((line for line in result["out"].splitlines() if line.startswith("run dir")), "")
    return result


def raw_run(precision: str, args: argparse.Namespace, compiled: bool = False) -> dict:
    raw_args = (f"--layers={BERT_BASE['layers']}", f"--hidden={BERT_BASE['hidden']}", f"--heads={BERT_BASE['heads']}",
                f"--seq-len={BERT_BASE['seq_len']}", f"--micro={args.micro}", f"--accum={args.accum}",
                *(("--compile",) if compiled else ()))
    result = run_raw(precision, args.log_every, args.steps, raw_args, nproc=1)
    result["samples_per_s"] = args.micro * args.accum / result["step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, default=128)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stop-at", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--eager", default="bf16,fp32,fp16", help="precisions of the eager rows")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS-DEFAULTS.md")
    args = parser.parse_args()
    name = torch.cuda.get_device_name(0)
    lines = ["# The launcher's defaults vs a hand-written loop, one GPU\n",
             f"1 x {name}; torch {torch.__version__}, CUDA {torch.version.cuda}; BERT-base (12 x 768, seq 128, random "
             f"tokens), micro-batch {args.micro}, accumulation {args.accum}, fused AdamW, clipping 1.0, one NCCL rank; "
             f"samples/s: the median log interval of {args.log_every} steps after the first; one run per cell, one "
             f"after the other.\n",
             ROW.format(what="launcher setting", launcher="launcher samples/s", raw="loop samples/s",
                        ratio="ratio", mfu="MFU launcher / loop", first="first step launcher / loop (s)", note="how it ran"),
             "|---|---|---|---|---|---|---|"]

    def row(what: str, ours: dict, theirs: dict, precision: str, first: str, note: str) -> None:
        mfus = [mfu(r["samples_per_s"], precision, 1) for r in (ours, theirs)]
        lines.append(ROW.format(what=what, launcher=f"{ours['samples_per_s']:.0f}", raw=f"{theirs['samples_per_s']:.0f}",
                                ratio=f"{ours['samples_per_s'] / theirs['samples_per_s']:.3f}",
                                mfu=" / ".join("n/a" if m is None else f"{m:.3f}" for m in mfus), first=first, note=note))
        args.out.write_text("\n".join(lines) + "\n")
        print(lines[-1], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        raw_bf16 = raw_run("bf16", args)
        cold = launcher_run(work / "defaults", args, stop_at=args.stop_at)
        restart = launcher_run(work / "defaults", args)
        last = cold["records"][-1]
        how = cold["first_line"].split("|", 3)[-1].strip()
        row("no speed flags", cold, raw_bf16, "bf16",
            f"cold {cold['first_log_s']:.1f} (to step {args.log_every}), restart {restart['first_step_s']:.1f} / "
            f"{raw_bf16['first_step_s']:.1f}",
            f"{how}; pieces {last.get('compiled_pieces')}, restart cache hits "
            f"{restart['summary'].get('compile_cache_hits')} ({restart['summary'].get('compile_cache')})")
        raw_compiled = raw_run("bf16", args, compiled=True)
        row("no speed flags vs the loop compiled", cold, raw_compiled, "bf16",
            f"- / {raw_compiled['first_step_s']:.1f}", "the loop: torch.compile then DDP (dynamo's split)")
        eager_first = None
        for precision in args.eager.split(","):
            ours = launcher_run(work / f"eager-{precision}", args, "train.compile=false", f"precision={precision}")
            theirs = raw_bf16 if precision == "bf16" else raw_run(precision, args)
            eager_first = eager_first or ours["first_step_s"]
            row(f"train.compile=false precision={precision}", ours, theirs, precision,
                f"{ours['first_step_s']:.1f} / {theirs['first_step_s']:.1f}", "eager")
        lines.append(f"\nA compiled restart's first step: {restart['first_step_s']:.1f} s; eager's: {eager_first:.1f} s "
                     f"(the restart loads its kernels from <run_dir>/compile_cache/).")
        args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
