"""train.best_metric: which eval so far was the best, so that its checkpoint outlives the rotation.

Every rank holds the same all-reduced eval metrics, so every rank decides alike, with no collective of its
own. An eval that improves on the best is saved as a checkpoint at once (an eval step need not be a
checkpoint step); train.keep_checkpoints then keeps the newest ones plus that one. The state travels in
every checkpoint, so a resume goes on comparing with the best before it, and rank 0 writes it to
<run_dir>/best.json at each save. Exercised by: tests/test_best_checkpoint.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher.derived import ConfigError
from launcher.rundir import BEST_FILE, step_dir, write_atomically


def best_mode(metric: str, mode: str | None) -> str:
    """max or min; unset, a loss (a name ending in loss) is best at its min, anything else at its max."""
    return mode or ("min" if metric.endswith("loss") else "max")


class Best:
    """The best eval so far of one metric (none without train.best_metric)."""

    def __init__(self, metric: str | None, mode: str | None):
        self.metric = metric
        self.mode = best_mode(metric, mode) if metric else None
        self.step: int | None = None  # the step of the best eval so far (its checkpoint is kept)
        self.value: float | None = None

    def improved(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether this step's eval is the best so far (strictly: of equal ones the first stays); then it is."""
        if not self.metric:
            return False
        if self.metric not in metrics:  # an eval that reports other names than the first samples' did
            self.check_among(list(metrics))
        value = metrics[self.metric]
        better = math.isfinite(value) and (self.value is None or
                                            (value > self.value if self.mode == "max" else value < self.value))
        if better:
            self.step, self.value = step, value
        return better

    def check_among(self, names: list[str]) -> None:
        """Refuse a train.best_metric that the job's eval does not report."""
        if self.metric and self.metric not in names:
            raise ConfigError(f"train.best_metric={self.metric} is not an eval metric of this job "
                              f"({', '.join(names) or 'it has no eval set'}); name one of them, or null")

    def state(self) -> dict[str, Any] | None:
        if self.step is None:
            return None
        return {"metric": self.metric, "mode": self.mode, "step": self.step, "value": self.value}

    def load(self, state: dict[str, Any] | None) -> None:
        """What the resumed checkpoint recorded, when it tracked the same metric the same way (the keys are no
        part of the trajectory: a resume may change them, and then compares from its next eval on)."""
        if state and (state["metric"], state["mode"]) == (self.metric, self.mode):
            self.step, self.value = state["step"], state["value"]

    def record(self, run_dir: Path) -> dict[str, Any] | None:
        """The best so far for best.json and summary.json (None while there is none)."""
        state = self.state()
        return state and {**state, "checkpoint": str(step_dir(run_dir, self.step))}

    def write(self, run_dir: Path) -> None:
        """Rank 0, once the checkpoint that holds this state is complete."""
        write_best(run_dir, self.record(run_dir))


def write_best(run_dir: Path, record: dict[str, Any] | None) -> None:
    """best.json from Best.record. None (no best yet, no metric, or another one than before a resume): no best.json,
    which model.pretrained=<run dir> would take for the best."""
    if record:
        write_atomically(run_dir / BEST_FILE, json.dumps(record, indent=2) + "\n")
    else:
        (run_dir / BEST_FILE).unlink(missing_ok=True)


def best_eval(task: Any, train_cfg: DictConfig) -> Best:
    """train.best_metric, checked against the job's eval metrics before the first step (their names come from
    eval_metrics, a function of the eval sums: of sums that are all 1 here, else of the first eval samples' own,
    where evaluation.probe_eval checks it)."""
    best = Best(train_cfg.best_metric, train_cfg.best_mode)
    if best.metric and task.eval_set is None:
        best.check_among([])
    elif best.metric:
        try:
            names = list(task.eval_metrics({key: 1.0 for key in task.eval_sum_keys}))
        except Exception:  # noqa: BLE001 - metrics that need real sums (a count of 1 - 1): probe_eval's
            return best
        best.check_among(names)
    return best
