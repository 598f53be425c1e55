"""The one place that writes run files and prints: rank 0 only, a no-op on every other rank.

metrics.jsonl gets one JSON object per logged step; summary.json the end of the run; samples.jsonl
(with train.log_samples) every step's sample ids; preempted.json a preemption's step.
Exercised by: `python -m launcher +exp=toy` (look at <run_dir>/metrics.jsonl).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from launcher.preempt import PREEMPTED_FILE


class RunLog:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self.start = time.time()
        self._metrics = self._samples = None

    def start_at(self, step: int) -> None:
        """Keep only the records up to `step`: later ones belong to work a restart threw away."""
        if not self.enabled:
            return
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.run_dir / name
            if path.exists():
                kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in kept))
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

    def warn(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def samples(self, step: int, ids_per_rank: list[list[int]]) -> None:
        if self.enabled:
            self._samples = self._samples or open(self.run_dir / "samples.jsonl", "a")
            self._samples.write(json.dumps({"step": step, "sample_ids": sum(ids_per_rank, [])}) + "\n")
            self._samples.flush()

    def preempted(self, step: int, signum: int) -> None:
        if self.enabled:
            (self.run_dir / PREEMPTED_FILE).write_text(json.dumps({"step": step, "signal": signum}) + "\n")
            self.info(f"preempted by signal {signum}: checkpoint saved at step {step}")

    def metrics(self, record: dict[str, Any], total_steps: int) -> None:
        if not self.enabled:
            return
        record = {**record, "time": round(time.time() - self.start, 3)}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        shown = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items() if k not in ("step", "time"))
        self.info(f"step {record['step']}/{total_steps} | {shown}")

    def summary(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        self.info(f"done: {record['steps']} steps in {record['wall_time_s']:.1f}s, final loss "
                  f"{_fmt(record['final_loss'])}; run dir {self.run_dir}")

    def close(self) -> None:
        for file in (self._metrics, self._samples):
            if file:
                file.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)
