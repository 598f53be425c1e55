"""The run dir's shared file names and their readers: what the workers write there (complete
checkpoints, hang reports) as the parent reads it back, for resume, status and the error line; a run dir
named where a pretrained model is expected (its newest checkpoint; the workers prefer its best, best.json);
and the one way both sides replace a small run-dir file (write_atomically).
Exercised by: tests/test_resume.py, tests/test_hang.py, tests/test_pretrained_runs.py and
`python -m launcher.launch.status <run dir>`.
"""
from __future__ import annotations

import json
import os
import platform
from contextlib import suppress
from pathlib import Path
from typing import Any

CHECKPOINTS_DIR = "checkpoints"  # <run_dir>/checkpoints/<step>/: one checkpoint (step_dir)
MARKER = "COMPLETE"  # in checkpoints/<step>/ once every file of the checkpoint is written
# in the final checkpoint, after it (its save comes first): the final eval of its weights and the best with it
EVAL_FILE = "eval.json"
LAUNCH_FILE = "launch.json"  # the parent writes it into every run dir before any worker starts
# Keys of model/ and data/ that name a pretrained model: a hub id, a save_pretrained dir, or a run dir
PRETRAINED_KEYS = ("pretrained", "tokenizer")
PRETRAINED_FILE = "pretrained.json"  # the checkpoints that such keys naming a run dir stand for, in this run
HANG_DIR = "hang"  # <run_dir>/hang/rank<N>.txt: a rank's hang report
BEST_FILE = "best.json"  # train.best_metric: the best eval so far and the step of its checkpoint
SUMMARY_FILE = "summary.json"  # rank 0's last write, at the end of a run (none after a preemption)
LOG_FILE = "launcher.log"  # what the launcher and rank 0 printed, every start of the run (launcher/launch/run_log.py)
ERROR_FILE = "error.txt"  # why the last start failed: its one line, then the failed rank's traceback


def write_atomically(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` so that a reader sees the old file or the new one, never half of one. The
    temp file is this host's and process's own: ranks, and nodes sharing the run dir, may write at once. A write
    that fails (a full disk) leaves no temp file behind."""
    tmp = path.with_name(f"{path.name}.{platform.node()}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):  # (the write's error is the one to tell)
            tmp.unlink(missing_ok=True)
        raise


def shown_number(value: float | None) -> str:
    """A number that metrics.jsonl or summary.json holds, as a line shows it (they write a non-finite one as null)."""
    return "inf/nan" if value is None else f"{value:.4g}"


def step_dir(run_dir: Path, step: int) -> Path:
    """The checkpoint of `step` (complete once it holds MARKER)."""
    return run_dir / CHECKPOINTS_DIR / str(step)


def complete_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints in run_dir, oldest first."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / MARKER).is_file())


def ended_summary(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """summary.json when it is that of a run that ended (not preempted) after `steps` steps: the parent then
    starts nothing, and workers that start after the final save leave it as it is."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):  # none: the run stopped before its end (or right after its final save)
        return None
    return summary if summary.get("steps") == steps and not summary.get("preempted") else None


def checkpoint_eval(checkpoint: Path) -> dict[str, Any] | None:
    """EVAL_FILE of a checkpoint ({"eval": metrics, "best": best state}), None before its eval was written."""
    try:
        return json.loads((checkpoint / EVAL_FILE).read_text())
    except (OSError, ValueError):  # (a half-written one is none: write_atomically writes none)
        return None


def best_record(run_dir: Path) -> dict[str, Any] | None:
    """best.json (train.best_metric: metric, mode, step, value, checkpoint), None when the run tracked no best."""
    try:
        return json.loads((run_dir / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_run_dir(path: object) -> bool:
    return isinstance(path, str) and (Path(path) / LAUNCH_FILE).is_file()


def newest_checkpoint(run_dir: Path) -> Path | None:
    steps = complete_steps(run_dir)
    return step_dir(run_dir, steps[-1]) if steps else None


def pinned_pretrained(run_dir: Path) -> dict[str, dict[str, str]]:
    """{"model.pretrained": {"run": run dir, "checkpoint": checkpoint dir}, ...} (absolute paths): what the keys
    that named a run dir meant at this run's first start (launcher/train/checkpoint.py pretrained_sources)."""
    path = run_dir / PRETRAINED_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def pinned_checkpoint(pinned: dict[str, dict[str, str]], name: str, value: object) -> str | None:
    """The checkpoint pinned for key `name` while it still names the same run (another value is a new choice), else
    the one another key pinned of that run: one checkpoint of each run (a run dir from before model.tokenizer was a
    key pinned data.tokenizer alone; the tokenizer's newest checkpoint then was no choice of this run's)."""
    run = str(Path(str(value)).resolve()) if is_run_dir(value) else None
    return next((entry["checkpoint"] for entry in (pinned.get(name), *pinned.values()) if entry and entry["run"] == run),
                None)


def hang_summary(run_dir: Path) -> str | None:
    """One line for the launcher's error: the ranks that stopped outside a collective (the ones the
    others waited for), where each was, and where the stacks are."""
    headers = []
    for report in sorted((run_dir / HANG_DIR).glob("rank*.txt")):
        try:
            headers.append(json.loads(report.read_text().splitlines()[0]))
        except (OSError, ValueError, IndexError):  # half-written by a rank that was killed meanwhile
            continue
    if not headers:
        return None
    where = lambda hs: "; ".join(f"rank {h['rank']} at step {h['step']} ({h['phase']}) in {h['where']}"  # noqa: E731
                                 for h in hs)
    stuck = [h for h in headers if not h["waiting"]]
    waiting = [h for h in headers if h["waiting"]]
    if stuck and waiting:
        return (f"hung: {where(stuck)}, while rank(s) {[h['rank'] for h in waiting]} waited for it in a "
                f"collective; stacks in {run_dir / HANG_DIR}")
    return f"hung: {where(headers)}; stacks in {run_dir / HANG_DIR}"
