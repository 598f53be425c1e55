"""The dirs a refused launch made: the sweep dir of a -m launch that fails before any point ran in it, and the
empty dirs above a refused run's dir (runs/<name>/ of a first launch), as the run dir itself is removed.

Hydra makes the sweep dir and writes its multirun.yaml before it composes the first point, so a bad override
(`python -m launcher -m +exp=toy train.lr=1e-3,1e-2`: no such key) left a dir holding only that file behind.
A Hydra callback (conf/config.yaml: hydra.callbacks) notes whether this launch made the dir; __main__ removes it
after a failed launch. Exercised by: tests/test_cli.py.
"""
from __future__ import annotations

import os
import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

MADE: list[tuple[Path, Path]] = []  # this launch's sweep dir, and the highest dir above it that it made
MADE_FOR_RUN: dict[Path, Path] = {}  # a run dir Hydra is about to make: the highest dir it makes with it
NOT_RUNS = {"multirun.yaml", "slurm"}  # what Hydra and a refused array's submission write there, no point's run dir


def absolute(path: str | Path) -> Path:
    """As the run's output_dir is (os.path.abspath: `..` resolved, links kept), to key MADE_FOR_RUN by."""
    return Path(os.path.abspath(path))


def highest_new(path: Path) -> Path:
    """The highest dir of `path` that is not there yet (itself when its parent is)."""
    made = path
    while not made.parent.exists():
        made = made.parent
    return made


def remove_empty_above(path: Path, made: Path) -> None:
    """The dirs above a removed `path` up to `made`, those still empty."""
    if path.exists():
        return
    for parent in path.parents:
        if parent == made.parent:
            break
        with suppress(OSError):  # not empty: another launch's run or sweep is in it now
            parent.rmdir()


class NewSweepDir(Callback):
    """Notes the sweep dir of a -m launch that makes it, and the dirs above a run dir that a launch makes."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:  # Hydra sets its config (which ${hydra:job.name} in the run dir reads) and makes the dir after this call
            HydraConfig.instance().set_config(config)
            run_dir = absolute(config.hydra.run.dir)  # (${now:} is cached: the same dir)
        except Exception:  # noqa: BLE001 - a dir we cannot tell: nothing noted, Hydra's own error tells of it
            return
        if not run_dir.exists():
            MADE_FOR_RUN[run_dir] = highest_new(run_dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            HydraConfig.instance().set_config(config)
            sweep_dir = absolute(config.hydra.sweep.dir)
        except Exception:  # noqa: BLE001 - as on_run_start
            return
        if not sweep_dir.exists():  # multirun/<name>/ too, on a first sweep
            MADE.append((sweep_dir, highest_new(sweep_dir)))


def discard_new_sweep_dir() -> None:
    """After a failed launch: the sweep dir it made, unless a point's run dir is in it, and the empty dirs above it
    that it made."""
    for sweep_dir, made in MADE:
        if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= NOT_RUNS:
            shutil.rmtree(sweep_dir, ignore_errors=True)
        remove_empty_above(sweep_dir, made)  # (a refused Slurm array's: slurm_submit.discard_queued removed it)
    MADE.clear()
