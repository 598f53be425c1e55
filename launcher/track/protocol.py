"""What every experiment tracker implements (Tracker), and what the parent and the workers share about a run's
tracker runs: trackers.json, the loggers picked, and the params, tags and summary each tracker gets.

One tracker run per training run: the parent opens it (launcher/launch/tracker_start.py) and records its id in
<run_dir>/trackers.json; every start of the workers (a relaunch into the run dir, a torchrun restart, a
Slurm requeue) reopens that run from there (launcher/track/trackers.py). A tracker that fails while training warns
once and is off for the rest of that start: training never stops for a tracker, and metrics.jsonl keeps every record.
Exercised by: `python -m launcher +exp=toy logger=[tensorboard,mlflow]`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from launcher.redact import redacted
from launcher.rundir import LAUNCH_FILE, write_atomically

TRACKERS_FILE = "trackers.json"  # the tracker runs of this run dir: {"mlflow": {"run_id": ...}, "wandb": {...}}
PACKAGES = {"mlflow": "mlflow-skinny sqlalchemy alembic", "wandb": "wandb"}  # what `pip install` needs


@dataclass(frozen=True)
class Resume:
    """Where this start of the workers begins: `step` 0 is a fresh run; `lost` says that an earlier start
    logged steps after `step` (its work was thrown away), which this start logs again."""

    step: int
    lost: bool


class Tracker:
    """What RunLog calls on rank 0; a backend overrides what it supports."""

    name = "tracker"

    def log(self, step: int, scalars: dict[str, float], kind: str) -> None:
        """`kind` is "train" (loss, lr, ...) or "eval" (the eval metrics); keys without a prefix."""

    def finish(self, summary: dict[str, Any]) -> None:
        """The run is done: its summary (scalars and the final checkpoint's path)."""

    def preempted(self, step: int) -> None:
        """The run stops for a requeue; it resumes in the same tracker run."""

    def close(self) -> None:
        """Flush and let go (also after finish or preempted; called more than once)."""


def enabled(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, settings) of each logger picked with logger=[...] (the others are null)."""
    for name, settings in (config.get("logger") or {}).items():
        if settings is not None:
            yield name, settings


def read_record(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TRACKERS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    write_atomically(run_dir / TRACKERS_FILE, json.dumps(record, indent=2) + "\n")


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as dotted keys -> strings (MLflow params), secrets redacted."""
    params = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flat_params(value, f"{name}."))
        else:
            value = redacted(name, value)
            params[name] = value if isinstance(value, str) else json.dumps(value)
    return params


def run_tags(run_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """What a tracker run is tagged with at each start: the experiment, the code, the shape it runs on."""
    launch = run_dir / LAUNCH_FILE
    revision = (json.loads(launch.read_text()).get("git") or {}).get("revision") if launch.is_file() else None
    tags = {"exp": config.get("name"), "git_sha": revision, "world_size": (config.get("plan") or {}).get("world_size"),
            "precision": (config.get("precision") or {}).get("name")}
    job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    tags["slurm_job_id"] = f"{job}_{task}" if job and task else os.environ.get("SLURM_JOB_ID")
    return {key: str(value) for key, value in tags.items() if value is not None}


def summary_scalars(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of summary.json (eval metrics as eval/<name>), for a tracker's run summary."""
    clocks = ("started_unix_time", "first_step_unix_time")  # times of day, not results
    scalars = {k: v for k, v in summary.items() if _number(v) and k not in clocks}
    scalars.update({f"eval/{k}": v for k, v in (summary.get("eval") or {}).items() if _number(v)})
    return scalars


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
