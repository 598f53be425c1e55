"""The trackers of a run, chosen by name from logger=[...] and called together by RunLog on rank 0 (launcher/train/
metrics.py): the first failure of one warns once and turns it off for the rest of that start.
Exercised by: `python -m launcher +exp=toy logger=[tensorboard,mlflow]`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from launcher.redact import redact
from launcher.track.mlflow_tracker import MlflowTracker
from launcher.track.protocol import TRACKERS_FILE, Resume, Tracker, enabled, read_record
from launcher.track.tensorboard_tracker import TensorBoardTracker
from launcher.track.wandb_tracker import WandbTracker


class Trackers:
    """The trackers of this run, called together; the first failure of one warns once and turns it off."""

    def __init__(self, warn: Callable[[str], None], record: dict[str, Any] | None = None):
        self.warn, self.active = warn, []
        # trackers.json's run ids, by tracker
        self.ids = {name: entry.get("run_id") or entry.get("id") for name, entry in (record or {}).items()}

    def add(self, name: str, make: Callable[[], Tracker]) -> None:
        try:
            self.active.append(make())
        except Exception as err:
            self._failed(name, err, "could not reopen its run")

    def call(self, method: str, *args: Any) -> None:
        for tracker in list(self.active):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:
                self.active.remove(tracker)
                self._failed(tracker.name, err, "failed")
                try:
                    tracker.close()
                except Exception:
                    pass

    def _failed(self, name: str, err: Exception, what: str) -> None:
        reason = redact("", (str(err).strip().splitlines() or [""])[0][:300])  # no credentials of a URI
        self.warn(f"warning: {name} {what} ({type(err).__name__}: {reason}); training goes on without it "
                  f"until the next start, metrics.jsonl keeps every record")


def open_trackers(run_dir: Path, config: dict[str, Any], resume: Resume, warn: Callable[[str], None]) -> Trackers:
    """The trackers that config["logger"] turns on, each reopening the run recorded in trackers.json."""
    record = read_record(run_dir)
    trackers = Trackers(warn, {name: record[name] for name, _ in enabled(config) if name in record})
    for name, settings in enabled(config):
        if name == "tensorboard":
            trackers.add(name, lambda: TensorBoardTracker(run_dir, resume))
        elif name not in record:
            warn(f"warning: logger={name} is on but {run_dir / TRACKERS_FILE} names no {name} run (the workers "
                 f"were not started by `python -m launcher`); {name} is off for this run")
        elif name == "mlflow":
            trackers.add(name, lambda: MlflowTracker(run_dir, config, settings, record[name], resume))
        elif name == "wandb":
            trackers.add(name, lambda: WandbTracker(run_dir, config, settings, record[name], resume))
    return trackers
