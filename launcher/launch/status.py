"""`python -m launcher.launch.status [run dir or sweep dir ...]`: the state of runs, one row each.

Per run: its state (Slurm's; RUNNING: a local launch; FAILED with its error line, DONE, PREEMPTED, DRY-RUN), last
step and loss, the last eval metrics, the best eval (train.best_metric) and the latest complete checkpoint; for a
sweep also each point's own overrides. Named no dir, it looks under ./runs and ./multirun (the launcher's defaults).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from launcher.launch.run_lock import lock_holder
from launcher.launch.run_log import failure_line
from launcher.launch.slurm_jobs import recorded_job, slurm_states
from launcher.preempt import PREEMPTED_FILE
from launcher.rundir import (ERROR_FILE, LAUNCH_FILE, SUMMARY_FILE, best_record, complete_steps, is_run_dir,
                             shown_number)


DEFAULT_ROOTS = ("runs", "multirun")  # conf/config.yaml's hydra.run.dir and hydra.sweep.dir, relative to the cwd
USAGE = "usage: python -m launcher.launch.status [run dir or sweep dir ...] (none: ./runs and ./multirun)"


def run_dirs(root: Path) -> list[Path]:
    """The run dir itself, or every run dir below a sweep dir: those whose config.yaml the launcher wrote, with a
    launch.json beside it (a dir of many runs may hold other programs' config.yaml too: a model's, Hydra's own)."""
    if (root / "config.yaml").is_file():
        return [root]
    found = [p.parent for p in root.rglob("config.yaml") if is_run_dir(str(p.parent))]
    return sorted(found, key=lambda p: (str(p.parent), p.name.zfill(8), str(p)))  # each sweep's points together


def describe(run_dir: Path, job: str | None, slurm: dict[str, str]) -> dict[str, Any]:
    """One row; slurm: the Slurm state of every job in the table."""
    row: dict[str, Any] = {"run": str(run_dir), "job": job or "-", "state": "-", "step": "-", "loss": "-",
                           "eval": "-", "best": "-", "checkpoint": "-"}
    error, summary = run_dir / ERROR_FILE, run_dir / SUMMARY_FILE
    if lock_holder(run_dir):  # a local launch's workers run (also in the run dir of a Slurm job that ended)
        row["state"] = "RUNNING"
    elif job and slurm[job] != "UNKNOWN":
        row["state"] = slurm[job]
    elif error.is_file() and (not summary.is_file() or error.stat().st_mtime >= summary.stat().st_mtime):
        row["state"] = "FAILED"  # the last start failed (a summary before it is an earlier start's end)
    elif summary.is_file():  # (a job that Slurm here cannot tell of: the run dir can)
        row["state"] = "DONE"
    elif (run_dir / PREEMPTED_FILE).is_file():
        row["state"] = "PREEMPTED"
    elif job:
        row["state"] = "UNKNOWN"
    elif _dry_run(run_dir):
        row["state"] = "DRY-RUN"  # launcher.dry_run=true wrote the config and started nothing
    metrics = run_dir / "metrics.jsonl"
    for record in map(json.loads, metrics.read_text().splitlines() if metrics.is_file() else []):
        if "loss" in record:
            row["step"], row["loss"] = record["step"], shown_number(record["loss"])
        if "eval" in record:
            row["eval"] = " ".join(f"{k}={shown_number(v)}" for k, v in record["eval"].items())
    best = best_record(run_dir)
    if best:  # a sweep over train.best_metric's runs: which point did best, and when
        row["best"] = f"{best['metric']}={best['value']:.4g}@{best['step']}"
    steps = complete_steps(run_dir)
    row["checkpoint"] = steps[-1] if steps else "-"
    return row


def _overrides(run_dir: Path) -> list[str]:
    """The command-line overrides of the run (launch.json), secrets already redacted."""
    try:
        return json.loads((run_dir / LAUNCH_FILE).read_text()).get("overrides") or []
    except (OSError, ValueError):
        return []


def _dry_run(run_dir: Path) -> bool:
    launcher = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("launcher") or {}
    return bool(launcher.get("dry_run")) and not (run_dir / "metrics.jsonl").exists()


def main(argv: list[str]) -> int:
    roots = argv or [d for d in DEFAULT_ROOTS if Path(d).is_dir()]  # none named: the launcher's default dirs here
    if any(arg.startswith("-") for arg in argv):
        print(USAGE, file=sys.stderr)
        return 2
    for root in argv:
        if not Path(root).is_dir():
            print(f"error: {root} is not a directory; name a run dir or a sweep dir (the launcher prints it)",
                  file=sys.stderr)
            return 2
    found: dict[Path, Path] = {}
    for root in roots:  # each run once, named as first given
        for run_dir in run_dirs(Path(root)):
            found.setdefault(run_dir.resolve(), run_dir)
    jobs = {run_dir: recorded_job(run_dir) for run_dir in found.values()}
    slurm = slurm_states([job for job in jobs.values() if job])  # one query for a whole sweep
    rows = [describe(run_dir, job, slurm) for run_dir, job in jobs.items()]
    if not rows:
        where = " or ".join(roots) if argv else f"./{' or ./'.join(DEFAULT_ROOTS)} (the launcher's default dirs)"
        print(f"error: no run dir (a config.yaml with a launch.json) under {where}; {USAGE}", file=sys.stderr)
        return 2
    if len(rows) > 1:  # a sweep: which values each point ran with (what all its points share, left out)
        overrides = {run_dir: _overrides(run_dir) for run_dir in jobs}
        shared = set.intersection(*(set(o) for o in overrides.values()))
        for row, run_dir in zip(rows, jobs):
            row["overrides"] = " ".join(o for o in overrides[run_dir] if o not in shared) or "-"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    for row in [dict(zip(columns, columns)), *rows]:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns).rstrip())
    for run_dir, row in zip(jobs, rows):  # why, in the failed start's own line (error.txt holds its traceback)
        if row["state"] == "FAILED" and failure_line(run_dir):
            print(f"{run_dir}: {failure_line(run_dir)} (more in {run_dir / ERROR_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
