"""train.compile_scope: the whole model compiled (today's default) against each block compiled on its own, on BERT.

Per scope (eager, model, block), the launcher on `+exp=bench` with a fresh run dir, as a new node sees it (an empty
machine compile cache: a TMPDIR of its own): the cold start until its first log, a Ctrl-C after step --stop-at
(a checkpoint), then the same command again on another empty TMPDIR: the restart resumes and loads its kernels from
the run dir's compile cache. Reported: seconds from the command to the first step (cold: to its first log, which
includes the compile; restart: to its first step) and the steady samples/s (the median log interval after the
first), with dynamo's graphs and pieces. Writes a markdown table to --out and prints it.
Run: python bench/compile_scope.py  (CPU: BERT 12 x 128, one rank; on a GPU: --gpu, BERT-base in bf16)
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from compare import REPO, launch

SCOPES = {"eager": ("train.compile=false",), "model": ("train.compile=true",),
          "block": ("train.compile=true", "train.compile_scope=block")}


def start(run_dir: Path, tmp: Path, args: argparse.Namespace, scope: str, stop_at: int | None) -> dict:
    """One launch; with stop_at, Ctrl-C once that step is logged (it saves a checkpoint and exits 75)."""
    workload = (f"model.layers={args.layers}", f"model.hidden={args.hidden}", f"model.heads={args.heads}",
                f"data.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro}",
                f"train.global_batch_size={args.micro * args.accum * args.nproc}", f"train.max_steps={args.steps}",
                f"train.log_every={args.log_every}", f"launcher.nproc_per_node={args.nproc}",
                f"precision={args.precision}")
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}  # inductor's machine cache is under TMPDIR: empty, as on a new node
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return launch([*workload, *SCOPES[scope]], run_dir, stop_at, env)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true", help="BERT-base (12 x 768), micro 128 x 4, bf16")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stop-at", type=int, default=15)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS-COMPILE-SCOPE.md")
    args = parser.parse_args()
    if args.gpu:
        args.hidden, args.heads, args.micro, args.accum, args.precision = 768, 12, 128, 4, "bf16"
        args.steps, args.stop_at = 60, 40
    where = torch.cuda.get_device_name(0) if args.gpu else f"{os.cpu_count()}-core CPU"
    lines = [f"{where}; torch {torch.__version__}; BERT {args.layers} x {args.hidden} ({args.heads} heads), seq "
             f"{args.seq_len}, random tokens, micro-batch {args.micro} x accumulation {args.accum}, {args.nproc} "
             f"rank(s), {args.precision}; each start on an empty machine compile cache; one run per cell.\n",
             "| run (eager, train.compile_scope=) | first log, cold (s) | first step, restart (s) | samples/s | "
             "graphs, pieces | restart cache hits |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as work:
        for scope in SCOPES:
            run_dir = Path(work) / scope
            cold = start(run_dir, Path(work) / f"{scope}-tmp1", args, scope, args.stop_at)
            restart = start(run_dir, Path(work) / f"{scope}-tmp2", args, scope, None)
            last = cold["records"][-1]
            graphs = f"{last['compiled_graphs']}, {last['compiled_pieces']}" if "compiled_graphs" in last else "-"
            lines.append(f"| {scope} | {cold['first_log_s']:.1f} | {restart['first_step_s']:.1f} | "
                         f"{cold['samples_per_s']:.1f} | {graphs} | "
                         f"{restart['summary'].get('compile_cache_hits', '-')} |")
            print(lines[-1], flush=True)
            args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
