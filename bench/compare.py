"""The launcher vs a minimal hand-written torchrun + DDP loop on the same workload, interleaved A B A B.

Per precision and round: seconds per optimizer step (median over log intervals after the first), the
launcher/raw ratio within the round, seconds from command start to the end of the first optimizer step,
peak memory of rank 0; on the CPU also gradient all-reduces per step (a comm hook) and the logging cost.
With CUDA (bench/gpu.py): BERT-base on every visible GPU, fp32/bf16/fp16, eager and compiled.
Run: python bench/compare.py [--rounds 3] [--compile off,on] [--no-ddp-split]
(CPU: about 30 minutes on 2 cores, writes bench/RESULTS.md; GPU: writes bench/RESULTS-GPU.md, see bench/gpu.py)
"""
from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
STEPS, LOG_EVERY, SYNC_STEPS = 20, 2, 4


def checked(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a benchmark command; on failure, stop with its own error output."""
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit code {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return out


def per_step(stamps: list[float], log_every: int = LOG_EVERY) -> float:
    """Median seconds per step over the log intervals after the first (which holds the warm-up)."""
    return statistics.median((b - a) / log_every for a, b in zip(stamps[1:], stamps[2:]))


def launch(overrides: list[str], run_dir: Path, stop_at: int | None = None,
           env: dict[str, str] | None = None, deadline_s: float = 900) -> dict:
    """`python -m launcher +exp=bench <overrides>` in run_dir to its end, or with stop_at a Ctrl-C once that step is
    logged (it saves a checkpoint, exit 75). Its output; its logged steps (`records`) and the median samples/s of
    the intervals after the first (compile, warm-up); with stop_at the seconds to its first log; after a whole run
    its summary and the seconds to its first step. Past `deadline_s` it is killed, and the bench exits with its
    output."""
    began = time.time()
    # Its output to a file, read at the end: a pipe nobody reads while the loop below waits for a step fills up
    # (64 KiB of compile warnings), the launcher blocks in a print, and the step never comes
    output = run_dir.with_name(run_dir.name + ".out")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "+exp=bench", *overrides,
                                 f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    first_log, metrics = None, run_dir / "metrics.jsonl"
    while stop_at is not None and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
        first_log = first_log or (time.time() - began if steps else None)
        if steps and max(steps) >= stop_at:
            proc.send_signal(signal.SIGINT)
            break
        if time.time() - began > deadline_s:  # (a device call's time is short: say what it printed, not hang)
            proc.kill()
            break
        time.sleep(0.1)
    try:
        proc.wait(timeout=max(deadline_s - (time.time() - began), 60))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out = output.read_text(errors="replace")
    if proc.returncode not in (0, 75):
        sys.exit(f"the launcher failed ({proc.returncode}):\n{out[-4000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    rates = sorted(r["samples_per_sec"] for r in logged[1:])
    result = {"out": out, "records": logged, "first_log_s": first_log,
              "samples_per_s": rates[len(rates) // 2] if rates else None, "summary": {}, "first_step_s": None}
    if proc.returncode == 0:
        summary, _ = launcher_stamps(run_dir)
        result.update(summary=summary, first_step_s=summary["first_step_unix_time"] - began)
    return result


def launcher_stamps(run_dir: Path) -> tuple[dict, list[float]]:
    """A launcher run's summary.json and the unix time of each of its logged training steps."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, [summary["started_unix_time"] + r["time"] for r in records if "loss" in r]


def run_launcher(precision: str, work: Path, log_every: int = LOG_EVERY, steps: int = STEPS,
                 extra: tuple[str, ...] = ()) -> dict:
    run_dir = work / f"launcher-{precision}-{time.time_ns()}"
    started = time.time()
    checked([sys.executable, "-m", "launcher", "+exp=bench", f"precision={precision}", f"train.max_steps={steps}",
             f"train.log_every={log_every}", *extra, f"hydra.run.dir={run_dir}"])
    summary, stamps = launcher_stamps(run_dir)
    return {"step_s": per_step(stamps, log_every) if len(stamps) > 2 else None,
            "first_step_s": summary["first_step_unix_time"] - started, "peak_mem_mb": summary["peak_mem_mb"],
            "micro_batch_size": summary["micro_batch_size"], "stamps": stamps, "first_step_unix_time": summary["first_step_unix_time"],
            "compiled": (summary.get("compiled_graphs"), summary.get("compiled_pieces"),  # with train.compile
                         summary.get("graph_breaks"))}


def compile_args(compiled: bool, one_graph: bool = False, mode: str | None = None) -> tuple[tuple[str, ...],
                                                                                          tuple[str, ...]]:
    """The launcher's overrides and raw_ddp.py's flags alike: eager, or compiled (in `mode`; as one graph
    instead of dynamo's pieces at DDP's buckets: train.compile_ddp_split=false, --no-ddp-split)."""
    if not compiled:
        return ("train.compile=false",), ()
    launcher, raw = ["train.compile=true"], ["--compile"]
    if mode:
        launcher.append(f"train.compile_mode={mode}")
        raw.append(f"--compile-mode={mode}")
    if one_graph:
        launcher.append("train.compile_ddp_split=false")
        raw.append("--no-ddp-split")
    return tuple(launcher), tuple(raw)


def logging_cost(work: Path, rounds: int) -> list[float]:
    """Launcher step time logging every step over logging every 50 steps (fp32), per round.

    Mean seconds per step: logging every step, from the 2nd log on (the 1st log imports TensorBoard, a
    one-off cost); logging every 50, from the end of the first step to the one log at the last step.
    """
    ratios = []
    for _ in range(rounds):
        stamps = run_launcher("fp32", work, log_every=1)["stamps"]
        every = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
        rare = run_launcher("fp32", work, log_every=50)
        rarely = (rare["stamps"][-1] - rare["first_step_unix_time"]) / (STEPS - 1)
        ratios.append(every / rarely)
        print(f"log every step / every 50: {ratios[-1]:.3f}", flush=True)
    return ratios


def raw_result(*args: str, nproc: int = 2) -> dict:
    out = checked([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   str(REPO / "bench" / "raw_ddp.py"), *args])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_raw(precision: str, log_every: int = LOG_EVERY, steps: int = STEPS, extra: tuple[str, ...] = (),
            nproc: int = 2) -> dict:
    started = time.time()
    result = raw_result(f"--precision={precision}", f"--steps={steps}", f"--log-every={log_every}", *extra, nproc=nproc)
    return {"step_s": per_step(result["stamps"], log_every), "first_step_s": result["first_step_unix_time"] - started,
            "peak_mem_mb": result["peak_mem_mb"]}


def count_launcher_syncs(work: Path) -> dict:
    from hydra import compose, initialize_config_dir

    from launcher.launch.plan import make_plan, resolve, write_config
    from launcher.schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+exp=bench"])
    config_path = write_config(work / "count", resolve(cfg, make_plan(cfg)))
    out = checked([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(REPO / "bench" / "count_syncs.py"), str(config_path), str(SYNC_STEPS)])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    if torch.cuda.is_available():
        from gpu import main as gpu_main  # bench/gpu.py, beside this file

        return gpu_main()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--compile", default="off,on", help="eager (off) and/or torch.compile on both sides (on)")
    parser.add_argument("--no-ddp-split", action="store_true", help="compiled rows as one graph on both sides")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode, precision in [(m, p) for m in args.compile.split(",") for p in args.precisions.split(",")]:
            compiled = mode == "on"
            launcher_extra, raw_extra = compile_args(compiled, args.no_ddp_split)
            rounds = []
            for r in range(args.rounds):  # A then B, every round
                launcher = run_launcher(precision, work, extra=launcher_extra)
                raw = run_raw(precision, extra=raw_extra)
                rounds.append((launcher, raw))
                print(f"{precision} {'compiled' if compiled else 'eager'} round {r + 1}: launcher "
                      f"{launcher['step_s']:.3f} s/step, raw {raw['step_s']:.3f} s/step, ratio "
                      f"{launcher['step_s'] / raw['step_s']:.3f}; first step {launcher['first_step_s']:.2f} s vs "
                      f"{raw['first_step_s']:.2f} s", flush=True)
            ratios = [a["step_s"] / b["step_s"] for a, b in rounds]
            rows.append({"precision": precision, "mode": "compiled" if compiled else "eager",
                         "launcher_step_s": statistics.median(a["step_s"] for a, _ in rounds),
                         "raw_step_s": statistics.median(b["step_s"] for _, b in rounds),
                         "ratio_median": statistics.median(ratios), "ratios": ratios,
                         "first_step_delta_s": statistics.median(a["first_step_s"] - b["first_step_s"] for a, b in rounds),
                         "launcher_first_step_s": statistics.median(a["first_step_s"] for a, _ in rounds),
                         "raw_first_step_s": statistics.median(b["first_step_s"] for _, b in rounds),
                         "launcher_rss_mb": max(a["peak_mem_mb"] for a, _ in rounds),
                         "raw_rss_mb": max(b["peak_mem_mb"] for _, b in rounds),
                         "compiled": {a["compiled"] for a, _ in rounds}})
        log_ratios = logging_cost(work, args.rounds)
        syncs = count_launcher_syncs(work)
        raw_syncs = raw_result("--count-syncs", f"--steps={SYNC_STEPS}", "--log-every=1")["syncs_per_step"]
    lines = ["# Benchmark: launcher vs a hand-written torchrun DDP loop\n",
             f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, {__import__('os').cpu_count()} cores; "
             f"torch {__import__('torch').__version__}; 2 ranks (gloo); BERT 4 x 256, 4 heads, seq 128, random tokens,"
             f" micro-batch 8, accumulation 4, AdamW, clipping 1.0; {args.rounds} interleaved rounds of {STEPS} steps"
             f"{'; compiled as one graph (no split at DDP buckets)' if args.no_ddp_split else ''}.\n",
             "| precision | mode | launcher s/step | raw s/step | ratio (median; per round) | first step: launcher / raw / "
             "delta (s) | peak RSS rank 0: launcher / raw (MB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['mode']} | {r['launcher_step_s']:.3f} | {r['raw_step_s']:.3f} | {r['ratio_median']:.3f}; "
                     f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | {r['launcher_first_step_s']:.2f} / "
                     f"{r['raw_first_step_s']:.2f} / {r['first_step_delta_s']:+.2f} | {r['launcher_rss_mb']:.0f} / "
                     f"{r['raw_rss_mb']:.0f} |")
    for r in rows:
        if r["mode"] == "compiled":
            lines.append(f"\n{r['precision']} compiled: the launcher's ranks compiled (graphs, pieces, graph breaks) "
                         f"{', '.join(map(str, sorted(r['compiled'])))} in its runs (summary.json).")
    lines.append(f"\nGradient all-reduces per optimizer step (comm-hook count, steps 2-{SYNC_STEPS}; one per DDP "
                 f"bucket): launcher {syncs['hook_calls_per_step']:g} in {syncs['sync_rounds_per_step']:g} sync "
                 f"round(s) per step, {'all' if syncs['only_in_last_micro_batch'] else 'NOT all'} in the last "
                 f"micro-batch's backward; raw loop {raw_syncs:g}.\n")
    lines.append(f"Launcher step time, logging every step / every 50 steps (fp32, {STEPS} steps, per round): "
                 f"{', '.join(f'{x:.3f}' for x in log_ratios)}; median {statistics.median(log_ratios):.3f}.\n")
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
