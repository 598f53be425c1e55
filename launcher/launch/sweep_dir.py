"""The sweep dir of a -m launch that fails before any point ran in it: removed, as a refused single run's dir is.

Hydra makes the sweep dir and writes its multirun.yaml before it composes the first point, so a bad override
(`python -m launcher -m +exp=toy train.lr=1e-3,1e-2`: no such key) left a dir holding only that file behind.
A Hydra callback (conf/config.yaml: hydra.callbacks) notes whether this launch made the dir; __main__ removes it
after a failed launch. Exercised by: tests/test_cli.py.
"""
from __future__ import annotations

import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

MADE: list[tuple[Path, Path]] = []  # this launch's sweep dir, and the highest dir above it that it made
NOT_RUNS = {"multirun.yaml", "slurm"}  # what Hydra and a refused array's submission write there, no point's run dir


class NewSweepDir(Callback):
    """Notes the sweep dir of a -m launch that makes it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = made = Path(config.hydra.sweep.dir).absolute()
        while not made.parent.exists():  # multirun/<name>/ too, on a first sweep
            made = made.parent
        if not sweep_dir.exists():
            MADE.append((sweep_dir, made))


def discard_new_sweep_dir() -> None:
    """After a failed launch: the sweep dir it made, unless a point's run dir is in it, and the empty dirs above it
    that it made."""
    for sweep_dir, made in MADE:
        if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= NOT_RUNS:
            shutil.rmtree(sweep_dir, ignore_errors=True)
        if not sweep_dir.exists():  # (a refused Slurm array's: slurm_submit.discard_queued removed it already)
            for parent in sweep_dir.parents:
                if parent == made.parent:
                    break
                with suppress(OSError):  # not empty: another launch's sweep is in it now
                    parent.rmdir()
    MADE.clear()
