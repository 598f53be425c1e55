"""Issue 38's numbers: what the host costs the step, with the defaults, against the settings before them.

Three workloads of the toy job on 1 rank, one after the other on this machine:
1. sampling: a lazy train set of 10^3 and of 10^9 samples (data.lazy): median samples/s, time to the first step,
   peak RSS;
2. prefetch: collate 20 ms per micro-batch (two per window) behind an 80 ms step: data_wait_frac and samples/s
   with train.num_workers=auto (the default) and 0 (the training thread, as before);
3. checkpoints: an MLP of 34M parameters with AdamW (about 405 MB of state) saved every 4 of 16 steps:
   ckpt_wait_s per save and the run's wall time with train.ckpt_async=true (the default) and false, against
   the same run without periodic saves, and a plain safetensors write + fsync of the same bytes.
With --gpu: +exp=bench as BERT-base on the GPU, data_wait_frac and ckpt_wait_s with the defaults.
Run: python bench/host_path.py --out bench/RESULTS-HOST-PATH.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
ONE = ("launcher.nproc_per_node=1", "train.eval_every=0")


def launch(run_dir: Path, *overrides: str) -> tuple[list[dict], dict, float]:
    """The launcher's records, summary and wall time (s) for one run."""
    began = time.time()
    out = subprocess.run([sys.executable, "-m", "launcher", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                         capture_output=True, text=True)
    wall = time.time() - began
    if out.returncode:
        sys.exit(out.stdout[-2000:] + out.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], json.loads((run_dir / "summary.json").read_text()), wall


def median(records: list[dict], key: str, skip: int = 1) -> float:
    return statistics.median(r[key] for r in records[skip:])


def sampling(tmp: Path) -> list[str]:
    rows = ["| train set | samples/s (median) | first step after launch (s) | peak RSS (MB) |", "|---|---|---|---|"]
    for n in (10**3, 10**9):
        began = time.time()
        records, summary, _ = launch(tmp / f"lazy{n}", "+exp=toy", *ONE, "data.lazy=true", f"data.n_samples={n}",
                                     "train.max_steps=60", "train.log_every=10")
        rows.append(f"| 10^{len(str(n)) - 1} | {median(records, 'samples_per_sec'):.0f} | "
                    f"{summary['first_step_unix_time'] - began:.1f} | {summary['peak_mem_mb']:.0f} |")
    return rows


def prefetch(tmp: Path) -> list[str]:
    slow = ("+exp=toy", *ONE, "train.max_steps=60", "train.global_batch_size=32", "train.micro_batch_size=16",
            "train.log_every=10", "data.collate_sleep_s=0.02", "data.sleep_s=0.04")
    rows = ["| train.num_workers | data_wait_frac (median) | samples/s (median) |", "|---|---|---|"]
    for workers in ("auto", "0"):
        records, _, _ = launch(tmp / f"workers-{workers}", *slow, f"train.num_workers={workers}")
        rows.append(f"| {workers} | {median(records, 'data_wait_frac'):.3f} | {median(records, 'samples_per_sec'):.0f} |")
    return rows


def plain_write_s(n_bytes: int, path: Path) -> float:
    began = time.perf_counter()
    save_file({"state": torch.rand(n_bytes // 4)}, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    took = time.perf_counter() - began
    path.unlink()
    return took


def checkpoints(tmp: Path) -> list[str]:
    big = ("+exp=toy", *ONE, "model.hidden=5800", "model.depth=3", "train.global_batch_size=16",
           "train.micro_batch_size=16", "train.max_steps=16", "train.log_every=1", "data.sleep_s=0.7")
    _, _, without = launch(tmp / "no-saves", *big, "train.ckpt_every=0")
    rows = ["| train.ckpt_async | ckpt_wait_s per save (steps 4, 8, 12) | run wall (s) | the saves' cost to the run, "
            "per save (s) |", "|---|---|---|---|"]
    state_bytes = 0
    for mode in ("true", "false"):
        run_dir = tmp / f"async-{mode}"
        records, _, wall = launch(run_dir, *big, "train.ckpt_every=4", f"train.ckpt_async={mode}")
        state_bytes = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "16").iterdir())
        waits = [r["ckpt_wait_s"] for r in records if r["step"] in (5, 9, 13)]
        rows.append(f"| {mode} | {', '.join(f'{w:.2f}' for w in waits)} | {wall:.1f} | {(wall - without) / 3:.2f} |")
    rows.append(f"| (no periodic save) | - | {without:.1f} | - |")
    plain = min(plain_write_s(state_bytes, tmp / "plain.safetensors") for _ in range(2))
    rows.append(f"\nState: {state_bytes / 1e6:.0f} MB; a plain safetensors write + fsync of those bytes: {plain:.2f} s "
                f"(the better of 2).")
    return rows


def gpu(tmp: Path) -> list[str]:
    from gpu import BERT_BASE
    workload = (f"model.layers={BERT_BASE['layers']}", f"model.hidden={BERT_BASE['hidden']}",
                f"model.heads={BERT_BASE['heads']}", f"data.seq_len={BERT_BASE['seq_len']}", "data.n_samples=8192",
                "train.micro_batch_size=128", "train.global_batch_size=512", "train.max_steps=60",
                "train.log_every=10", "train.ckpt_every=20", "train.eval_every=0")
    records, summary, _ = launch(tmp / "bert-base", "+exp=bench", *workload)
    return ["| +exp=bench BERT-base, defaults | data_wait_frac (median) | ckpt_wait_s at steps 21-30, 41-50 | "
            "samples/s (median) |", "|---|---|---|---|",
            f"| {torch.cuda.get_device_name()} | {median(records, 'data_wait_frac'):.3f} | "
            f"{', '.join(str(round(r['ckpt_wait_s'], 2)) for r in records if r['step'] in (30, 50))} | "
            f"{median(records, 'samples_per_sec'):.0f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--gpu", action="store_true", help="only the GPU workload")
    args = parser.parse_args()
    lines = [f"Machine: {os.uname().machine}, {os.cpu_count()} cores; torch {torch.__version__}; "
             f"{time.strftime('%Y-%m-%d')}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        parts = [("GPU", gpu)] if args.gpu else [("Sampling", sampling), ("Prefetch", prefetch),
                                                 ("Checkpoints", checkpoints)]
        for title, part in parts:
            lines += [f"### {title}", "", *part(Path(tmp)), ""]
            print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
