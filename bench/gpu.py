"""The GPU half of bench/compare.py: the launcher vs the hand-written loop (bench/raw_ddp.py in its CUDA
mode) on BERT-base (12 x 768, 12 heads, seq 128, random tokens) on every visible GPU, NCCL.

Per precision (fp32 with TF32, bf16, fp16) and mode (eager, compiled), interleaved rounds (launcher
first in odd rounds, raw first in even ones): samples/s (global batch over the median step time after
warm-up), the ratio within the round, MFU (6 x non-embedding parameters x tokens/s over the GPUs'
bf16/fp16 peak, half that for fp32), peak memory (max_memory_allocated, rank 0) and seconds to the end
of the first step.
Run: python bench/compare.py [--rounds 2] [--micro 128] [--precisions fp32,bf16,fp16] [--compile off,on]
     [--compile-mode reduce-overhead --accum 1] [--no-ddp-split]
--no-ddp-split compiles both sides as one graph (train.compile_ddp_split=false; raw_ddp.py --no-ddp-split)
instead of dynamo's pieces at DDP's gradient buckets.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import cache, partial
from pathlib import Path

import torch

from compare import REPO, compile_args, run_launcher, run_raw

BERT_BASE = {"layers": 12, "hidden": 768, "heads": 12, "seq_len": 128}


@cache
def flops_per_token() -> float:
    """BERT-base's training FLOPs per token, from a model built once (the table is written after every row)."""
    from jobs.bench import bert_from_config
    from launcher.train.meter import training_flops_per_item

    return training_flops_per_item(bert_from_config(BERT_BASE["layers"], BERT_BASE["hidden"], BERT_BASE["heads"],
                                                    max_length=BERT_BASE["seq_len"]))


def mfu(samples_per_s: float, precision: str, gpus: int) -> float | None:
    from launcher.train.meter import peak_flops

    peak = peak_flops(torch.device("cuda", 0), precision)
    if peak is None:
        return None
    return flops_per_token() * samples_per_s * BERT_BASE["seq_len"] / (peak * gpus)


def one_round(precision: str, compiled: bool, args: argparse.Namespace, gpus: int, work: Path,
              raw_first: bool) -> tuple[dict, dict]:
    """The launcher's and the raw loop's run, in the order given: rounds alternate it, since the second run
    of a round finds inductor's kernels (both compile the same model) and the GPU as the first left them."""
    global_batch = args.micro * args.accum * gpus
    launcher_compile, raw_compile = compile_args(compiled, args.no_ddp_split, args.compile_mode)
    launcher_args = (
        f"model.layers={BERT_BASE['layers']}", f"model.hidden={BERT_BASE['hidden']}",
        f"model.heads={BERT_BASE['heads']}", f"data.seq_len={BERT_BASE['seq_len']}",
        f"data.n_samples={max(4096, 2 * global_batch)}", "launcher.device=cuda", f"launcher.nproc_per_node={gpus}",
        f"train.micro_batch_size={args.micro}", f"train.global_batch_size={global_batch}",
        *launcher_compile)
    raw_args = (
        f"--layers={BERT_BASE['layers']}", f"--hidden={BERT_BASE['hidden']}", f"--heads={BERT_BASE['heads']}",
        f"--seq-len={BERT_BASE['seq_len']}", f"--micro={args.micro}", f"--accum={args.accum}",
        *raw_compile)
    launch = partial(run_launcher, precision, work, args.log_every, args.steps, launcher_args)
    raw_loop = partial(run_raw, precision, args.log_every, args.steps, raw_args, nproc=gpus)
    if raw_first:
        raw, launcher = raw_loop(), launch()
    else:
        launcher, raw = launch(), raw_loop()
    for result in (launcher, raw):
        result["samples_per_s"] = global_batch / result["step_s"]
    return launcher, raw


def write_table(rows: list[dict], args: argparse.Namespace, gpus: int) -> list[str]:
    """The results so far as a markdown table, written to args.out (after every row: a run cut off keeps
    the rows it finished)."""
    name = torch.cuda.get_device_name(0)
    lines = ["# GPU benchmark: launcher vs a hand-written torchrun + NCCL DDP loop\n",
             f"{gpus} x {name}; torch {torch.__version__}, CUDA {torch.version.cuda}; BERT-base (12 x 768, 12 heads, "
             f"seq 128, random tokens), micro-batch {args.micro}, accumulation {args.accum}, fused AdamW, clipping 1.0; "
             f"{args.rounds} interleaved rounds (launcher first, then raw first, ...) of {args.steps} steps, timed after "
             f"step {2 * args.log_every}"
             f"{f'; compiled with mode {args.compile_mode}' if args.compile_mode else ''}"
             f"{'; compiled as one graph (no split at DDP buckets)' if args.no_ddp_split else ''}.\n",
             "| precision | mode | launcher samples/s | raw samples/s | ratio (median; per round) | MFU launcher / raw "
             "| peak memory launcher / raw (GB) | first step launcher / raw (s) | launcher graphs, pieces, breaks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfus = [mfu(r[f"{who}_samples_per_s"], r["precision"], gpus) for who in ("launcher", "raw")]
        lines.append(
            f"| {r['precision']} | {'compiled' if r['compiled'] else 'eager'} | {r['launcher_samples_per_s']:.0f} | "
            f"{r['raw_samples_per_s']:.0f} | {statistics.median(r['ratios']):.3f}; "
            f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | "
            f"{' / '.join('n/a' if m is None else f'{m:.3f}' for m in mfus)} | "
            f"{r['launcher_peak_mem_mb'] / 1024:.1f} / {r['raw_peak_mem_mb'] / 1024:.1f} | "
            f"{r['launcher_first_step_s']:.1f} / {r['raw_first_step_s']:.1f} | "
            f"{'; '.join(', '.join(map(str, g)) for g in sorted(r['graphs'])) if r['compiled'] else '-'} |")
    args.out.write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro", type=int, default=128)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--compile", default="off,on")
    parser.add_argument("--compile-mode", default=None,
                        help="train.compile_mode for compiled rows; CUDA-graph modes need --accum 1")
    parser.add_argument("--no-ddp-split", action="store_true", help="compiled rows as one graph on both sides")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS-GPU.md")
    args = parser.parse_args()
    # The step time is the median over the log intervals after the first: at least two whole ones.
    if args.log_every < 1 or args.steps % args.log_every or args.steps < 3 * args.log_every:
        parser.error(f"--steps={args.steps} must be a multiple of --log-every={args.log_every}, at least 3 of them")
    gpus = torch.cuda.device_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for compiled in [mode == "on" for mode in args.compile.split(",")]:
            for precision in args.precisions.split(","):
                rounds = []
                for i in range(args.rounds):  # launcher first, then raw first, ...
                    launcher, raw = one_round(precision, compiled, args, gpus, Path(tmp), raw_first=i % 2 == 1)
                    rounds.append((launcher, raw))
                    print(f"  round {i + 1} ({'raw' if i % 2 else 'launcher'} first): launcher "
                          f"{launcher['samples_per_s']:.0f}, raw {raw['samples_per_s']:.0f} samples/s; first step "
                          f"{launcher['first_step_s']:.1f} / {raw['first_step_s']:.1f} s", flush=True)
                ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in rounds]
                row = {"precision": precision, "compiled": compiled, "ratios": ratios,
                       **{f"{who}_{key}": statistics.median(r[i][key] for r in rounds)
                          for i, who in enumerate(("launcher", "raw"))
                          for key in ("samples_per_s", "peak_mem_mb", "first_step_s")},
                       "graphs": {launcher["compiled"] for launcher, _ in rounds}}
                rows.append(row)
                write_table(rows, args, gpus)
                print(f"{precision} {'compiled' if compiled else 'eager'}: launcher {row['launcher_samples_per_s']:.0f}"
                      f" samples/s, raw {row['raw_samples_per_s']:.0f}, ratios {', '.join(f'{x:.3f}' for x in ratios)}",
                      flush=True)
    print("\n".join(write_table(rows, args, gpus)))
