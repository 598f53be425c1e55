"""strategy.meta_init's numbers: each rank's host memory and the start's time, rank 0 building alone against
every rank building the whole model, interleaved A B A B.

+exp=bench with BERT-base's shape (12 x 768, 110M parameters, 440 MB in float32, built from its config with
random weights) under strategy=fsdp on 3 gloo ranks, train.max_steps=0: the start builds, shards, runs the
workers' probes of the job (a forward and backward of a micro-batch: on CPU ranks its activations and unsharded
gradients are host memory too) and stops. Each rank's peak RSS (VmHWM, read from /proc every 50 ms) once the
workers say what they sharded (after the build), and over the whole start. Start time: from the workers'
rendezvous to their last phase (launcher.log).
Run: python bench/meta_init.py [--rounds 2] [--ranks 3] --out bench/RESULTS-META-INIT.md
"""
from __future__ import annotations

import argparse
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
COMMON = ("+exp=bench", "launcher.device=cpu", "strategy=fsdp", "model.layers=12", "model.hidden=768",
          "model.heads=12", "train.global_batch_size=48", "train.max_steps=0", "train.eval_every=0")
VARIANTS = {"rank 0 builds, the others on meta (strategy.meta_init=true, the default)": "strategy.meta_init=true",
            "every rank builds whole (strategy.meta_init=false)": "strategy.meta_init=false"}


def peak_rss_mb(pid: int) -> tuple[int | None, float]:
    """A worker's rank (None: not a worker) and its peak RSS so far."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None, 0.0
    if b"TORCHELASTIC_RUN_ID" not in b"\0".join(environ) or "launcher.train.worker" not in \
            Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
        return None, 0.0
    rank = next(int(v[5:]) for v in environ if v.startswith(b"RANK="))
    return rank, int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


def run(run_dir: Path, ranks: int, variant: str) -> dict:
    output = run_dir.with_name(run_dir.name + ".out")  # (a pipe read only at the end could fill and block it)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as sink:
        launcher = subprocess.Popen([sys.executable, "-m", "launcher", *COMMON, f"launcher.nproc_per_node={ranks}",
                                     variant, f"hydra.run.dir={run_dir}"], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    peaks: dict[int, float] = {}
    built: list[float] | None = None
    while launcher.poll() is None:  # VmHWM only grows: its last reading before the exit is the peak
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                rank, mb = peak_rss_mb(int(proc.name))
                if rank is not None:
                    peaks[rank] = max(peaks.get(rank, 0.0), mb)
        log = run_dir / "launcher.log"
        if built is None and log.exists() and "strategy=fsdp: sharded" in log.read_text():
            built = [peaks[r] for r in sorted(peaks)]  # the workers' line after the build (read within 50 ms)
        time.sleep(0.05)
    if launcher.returncode:
        sys.exit(output.read_text(errors="replace")[-3000:])
    seconds = [float(s) for s in re.findall(r"\((\d+\.\d)s after the launch\)", (run_dir / "launcher.log").read_text())]
    return {"built": built, "peaks": [peaks[r] for r in sorted(peaks)], "start_s": seconds[1] - seconds[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for i, (name, variant) in enumerate(VARIANTS.items()):
                results[name].append(run(Path(tmp) / f"{i}-{round_}", args.ranks, variant))
                print(name, round_, results[name][-1], flush=True)
    lines = [f"# strategy.meta_init: rank 0 builds alone ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {platform.machine()}, cpu, {torch.get_num_threads()} threads; torch {torch.__version__}; "
             f"`{' '.join(COMMON)} launcher.nproc_per_node={args.ranks}`; {args.rounds} interleaved rounds.", "",
             "| build | peak RSS per rank once built, MB | all ranks | peak RSS per rank, whole start, MB | all ranks "
             "| start s (median; per round) |", "|---|---|---|---|---|---|"]
    for name, rounds in results.items():
        row = []
        for key in ("built", "peaks"):
            peaks = [statistics.median(r[key][rank] for r in rounds) for rank in range(args.ranks)]
            row += [" / ".join(f"{p:.0f}" for p in peaks), f"{sum(peaks):.0f}"]
        times = [r["start_s"] for r in rounds]
        lines.append(f"| {name} | {' | '.join(row)} | {statistics.median(times):.1f}; "
                     f"{', '.join(f'{t:.1f}' for t in times)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
