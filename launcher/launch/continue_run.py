"""The same command continues: a launch without hydra.run.dir goes on in the run dir of its command's last run
when that run is unfinished, instead of starting over in a new timestamped dir.

The last run of the same experiment (a sibling under runs/<name>/) continues when it was launched with exactly
these overrides, trained the same trajectory config and holds no end (summary.json). Where a launch or a Slurm job
still runs there, the launch says so and starts nothing, as in any run dir: the same command typed again in another
terminal does not train a second copy of the run from step 0 beside it. A finished run, a changed config,
resume=never, a sweep or an explicit hydra.run.dir start a new run dir, as always.
Exercised by: tests/test_failures_on_record.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from launcher.derived import differing_keys, trajectory_config
from launcher.launch.plan import make_plan, resolve
from launcher.redact import redact_override
from launcher.rundir import LAUNCH_FILE, SUMMARY_FILE


def continued_run_dir(cfg: DictConfig, fresh: Path) -> Path | None:
    """The unfinished run dir this command continues, or None: train in `fresh`, the dir Hydra made."""
    hydra = HydraConfig.get()
    chosen = {override.split("=", 1)[0].lstrip("+~") for override in hydra.overrides.hydra}
    if hydra.mode == RunMode.MULTIRUN or "hydra.run.dir" in chosen or cfg.resume.mode == "never":
        return None
    overrides = [redact_override(arg) for arg in hydra.overrides.task]
    last = _last_run_of(fresh, overrides)
    if last is None or (last / SUMMARY_FILE).is_file():
        return None
    try:
        config = resolve(cfg, make_plan(cfg))
        previous = OmegaConf.to_container(OmegaConf.load(last / "config.yaml"))
    except Exception:  # noqa: BLE001 - any error of the config is the launch's to report, in its own words
        return None
    return None if differing_keys(trajectory_config(previous), trajectory_config(config)) else last


def _last_run_of(fresh: Path, overrides: list[str]) -> Path | None:
    """The newest sibling of `fresh` (Hydra's run dirs are named by their start time) launched with these overrides."""
    siblings = sorted((p for p in fresh.parent.iterdir() if p != fresh and (p / "config.yaml").is_file()),
                      key=lambda p: p.name, reverse=True) if fresh.parent.is_dir() else []
    for run_dir in siblings:
        try:
            record: dict[str, Any] = json.loads((run_dir / LAUNCH_FILE).read_text())
        except (OSError, ValueError):
            continue
        if record.get("overrides") == overrides:
            return run_dir
    return None
