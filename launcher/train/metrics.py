"""The one place that writes run files and prints: rank 0 only, a no-op on every other rank.

metrics.jsonl and the trackers of logger=[...] (TensorBoard in tb/, MLflow, W&B: launcher/track/)
get the same scalars per logged step; summary.json the end of the run; samples.jsonl (with
train.log_samples) every step's sample ids; preempted.json a preemption's step.
On a TTY rank 0 shows a progress bar; elsewhere (CI, Slurm logs) a plain line per logged step.
Exercised by: `python -m launcher +exp=toy` (look at <run_dir>/metrics.jsonl and tb/).
"""
from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from launcher.preempt import write_preempted
from launcher.rundir import BEST_FILE, LOG_FILE, SUMMARY_FILE, ended_summary
from launcher.track.protocol import Resume
from launcher.track.trackers import Trackers, open_trackers

FALLING_SCALE_LOGS = 3  # an fp16 loss scale that fell at this many logged steps in a row is worth a warning
STRAGGLER_LOGS = 3  # a rank slower than train.straggler_ratio x the median at this many logs in a row: warn


class RunLog:
    def __init__(self, run_dir: Path, enabled: bool, straggler_ratio: float = 1.2,
                 config: dict[str, Any] | None = None):
        self.run_dir, self.enabled, self.straggler_ratio = run_dir, enabled, straggler_ratio
        self.config = config if config is not None else {"logger": {"tensorboard": {}}}  # what picks the trackers
        self.start = time.time()
        self._metrics = self._samples = self._bar = self._log = None
        self._from_step, self._from_time = 0, self.start  # this start's first step, and when it began (start_at)
        self._trackers = Trackers(self.warn)
        self._scales: list[float] = []
        self._slowest: list[int | None] = []  # per log: the rank over the ratio, or None

    def start_at(self, step: int, total_steps: int) -> None:
        """Keep only the records up to `step` (later ones belong to work a restart threw away; a fresh start, step 0,
        keeps none: not even an evaluation without training, train.max_steps=0, of an earlier start); open files."""
        if not self.enabled:
            return
        self._from_step, self._from_time = step, time.time()
        lost = False  # did an earlier start log steps after `step`? The trackers log them again
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.run_dir / name
            if path.exists():
                lines = path.read_text().splitlines()
                kept = [line for line in lines if step and json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in kept))
                lost = lost or (name == "metrics.jsonl" and len(kept) < len(lines))
        if not step:  # what an earlier start ended with is not this run's
            for name in (SUMMARY_FILE, BEST_FILE):
                (self.run_dir / name).unlink(missing_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")
        self._trackers = open_trackers(self.run_dir, self.config, Resume(step, lost), self.warn)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                                 TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total_steps, completed=step, status="")
            self._bar.start()

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stdout, flush=True)
        self._keep(message)

    def warn(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)
            self._keep(message)

    def _keep(self, message: str) -> None:
        """Rank 0's lines go to <run_dir>/launcher.log too, beside the launcher's own (launcher/launch/run_log.py)."""
        if self._log is None:
            self._log = open(self.run_dir / LOG_FILE, "a", buffering=1)
        self._log.write(message + "\n")

    def advance(self) -> None:
        if self._bar:
            self._bar.update(self._task, advance=1)

    def metrics(self, record: dict[str, Any], total_steps: int) -> None:
        if not self.enabled:
            return
        record = {**record, "time": round(time.time() - self.start, 3)}
        self._metrics.write(strict_json(record) + "\n")
        self._metrics.flush()
        for kind, values in (("train", record), ("eval", record.get("eval", {}))):
            scalars = {k: v for k, v in values.items() if _number(v) and k not in ("step", "time")}
            if scalars:
                self._trackers.call("log", record["step"], scalars, kind)
        shown = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items() if k not in ("step", "time") and v is not None)
        if self._bar and "eval" not in record:  # a short status: a line wider than the terminal breaks the bar
            self._bar.update(self._task, status=" | ".join(
                f"{k} {_fmt(record[k])}" for k in ("loss", "lr", "samples_per_sec") if k in record))
        else:  # off a terminal the line carries the bar's ETA: this start's pace so far, to the last step
            done = record["step"] - self._from_step
            eta = (total_steps - record["step"]) * (time.time() - self._from_time) / done if done > 0 else None
            self.info(f"step {record['step']}/{total_steps} | {shown}" +
                      (f" | eta {_duration(eta)}" if eta is not None and "eval" not in record else ""))
        if "loss_scale" in record:
            self._watch_scale(record)
        if "step_time_max_over_median" in record:
            self._watch_stragglers(record)

    def _watch_stragglers(self, record: dict[str, Any]) -> None:
        """One rank that stays slower than the others (a throttled GPU, a busy host) slows every rank."""
        over = record["step_time_max_over_median"] > self.straggler_ratio
        self._slowest.append(record["slowest_rank"] if over else None)
        recent = self._slowest[-STRAGGLER_LOGS:]
        if len(recent) == STRAGGLER_LOGS and recent[0] is not None and len(set(recent)) == 1:
            self.warn(f"warning: rank {recent[0]} is a straggler: its compute time per step was "
                      f"{record['step_time_max_over_median']:.2f}x the median rank's at the last {STRAGGLER_LOGS} "
                      f"logs (train.straggler_ratio={self.straggler_ratio}), and every rank waits for it; look at its "
                      f"GPU (clocks, temperature) or host (other processes, data loading)")
            self._slowest.clear()  # once per streak

    def _watch_scale(self, record: dict[str, Any]) -> None:
        """fp16: a loss scale that keeps falling means the gradients keep overflowing."""
        self._scales.append(record["loss_scale"])
        recent = self._scales[-FALLING_SCALE_LOGS - 1:]
        if len(recent) > FALLING_SCALE_LOGS and all(b < a for a, b in zip(recent, recent[1:])):
            self.warn(f"warning: the fp16 loss scale keeps falling ({recent[0]:g} -> {recent[-1]:g} over the last "
                      f"{FALLING_SCALE_LOGS} logs, {record['skipped_steps']} skipped steps): gradients overflow; "
                      f"try precision=bf16, a lower optimizer.lr, or train.max_grad_norm")

    def samples(self, step: int, ids_per_rank: list[list[int]]) -> None:
        if self.enabled:
            self._samples = self._samples or open(self.run_dir / "samples.jsonl", "a")
            self._samples.write(json.dumps({"step": step, "sample_ids": sum(ids_per_rank, [])}) + "\n")
            self._samples.flush()

    def preempted(self, step: int, signum: int) -> None:
        if self.enabled:
            write_preempted(self.run_dir, step, signum)
            self._trackers.call("preempted", step)
            how = "stopped" if signum == signal.SIGINT else "preempted"  # SIGINT: Ctrl-C
            # into launcher.log only: the launcher prints the stop once, with how to resume (launcher/preempt.py)
            self._keep(f"{how} by signal {signum}: checkpoint saved at step {step}")

    def summary(self, record: dict[str, Any], ended_before: bool = False, then: Callable[[], Any] = lambda: None) -> None:
        """summary.json, the trackers' end and the table. `ended_before`: this start began after the run's final
        save; when that start wrote its summary too, it stands (its time and throughput, one end in the trackers).
        `then` runs on every rank once summary.json is there (a collective that every rank enters)."""
        if not self.enabled:
            then()
            return
        if ended_before and ended_summary(self.run_dir, record["steps"]):
            then()
            self.close()
            self.info(f"done: the run had ended before this start ({self.run_dir / 'summary.json'} stands); final loss "
                      f"{_fmt(record['final_loss'])}")
            return
        (self.run_dir / SUMMARY_FILE).write_text(strict_json(record, indent=2) + "\n")
        then()
        self._trackers.call("finish", record)
        self.close()
        from rich.console import Console
        from rich.table import Table

        table = Table(show_header=False)  # (the line below names the run dir: a path a table would wrap)
        trained = ("wall_time_s", "samples_per_sec", "final_loss") if record["steps"] else ()  # none: an evaluation
        for key in ("steps", *trained, "eval", "best", "skipped_steps",
                    "restarts", "world_size", "micro_batch_size", "grad_accum_steps", "precision", "peak_mem_mb", "compiled_graphs",
                    "compiled_pieces", "graph_breaks", "cudagraph_skips", "host_syncs", "checked_steps", "checkpoint",
                    "profile"):
            if record.get(key) not in (None, {}):  # ({}: a job without an eval set)
                table.add_row(key, _fmt(record[key]))
        Console(file=sys.stdout, width=120).print(table)
        steps, resumed_from = record["steps"], record["resumed_from"]
        if steps == 0:  # train.max_steps=0
            evaluated = _fmt(record.get("eval")) or "none (the job has no eval set)"
            self.info(f"done: evaluated without training, eval {evaluated}; run dir {self.run_dir}")
        elif resumed_from == steps:  # nothing was left to train (a preemption at the last step)
            self.info(f"done: the run had trained its {steps} steps before this start, final loss "
                      f"{_fmt(record['final_loss'])}; run dir {self.run_dir}")
        else:  # this start's steps, and their time
            trained = f"{steps - resumed_from} steps (steps {resumed_from + 1}-{steps})" if resumed_from else \
                f"{steps} steps"
            self.info(f"done: {trained} in {record['wall_time_s']:.1f}s, final loss {_fmt(record['final_loss'])}; "
                      f"run dir {self.run_dir}")
        if "profile" in record:
            self.info(f"profile: open the .pt.trace.json files of {record['profile']} in ui.perfetto.dev, or run "
                      f"tensorboard --logdir {record['profile']}")

    def close(self) -> None:
        if self._bar:
            self._bar.stop()
            self._bar = None
        for file in (self._metrics, self._samples):
            if file:
                file.close()
        self._metrics = self._samples = None
        self._trackers.call("close")

    def tracker_ids(self) -> dict[str, str]:
        """The tracker runs this run logs to (kept in checkpoints too; trackers.json is the record)."""
        return self._trackers.ids


def strict_json(record: dict[str, Any], indent: int | None = None) -> str:
    """JSON that strict readers (JavaScript's JSON.parse, dashboards) take: a non-finite number (the loss of a run
    that diverged, or of one that trained no step) is null, not NaN."""
    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(item) for item in value]
        return value
    return json.dumps(finite(record), indent=indent, allow_nan=False)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)
