"""The one place that writes run files and prints: rank 0 only, a no-op on every other rank.

metrics.jsonl gets one JSON object per logged step; summary.json the end of the run.
Exercised by: `python -m launcher +exp=toy` (look at <run_dir>/metrics.jsonl).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class RunLog:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self.start = time.time()
        self._metrics = open(run_dir / "metrics.jsonl", "a") if enabled else None

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

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
        if self._metrics:
            self._metrics.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)
