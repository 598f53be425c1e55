"""Every point of a -m sweep checked before the first one runs.

Hydra's basic launcher runs a local sweep's points one after the other, and each point's checks ran as it started:
`-m train.global_batch_size=32,30` trained point 0 to its end, then refused point 1 (30 does not divide), hours
into a real sweep. Hydra composes every point up front (its keys); the launcher's own checks (the plan, the
optimizer's values, the job's inputs) now run for every point at the first one, and a refused point stops the
sweep before any trained. (A Slurm sweep was whole already: its points are submitted once all are checked.)
Exercised by: tests/test_cli.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from launcher.derived import ConfigError

POINTS: list[list[str]] = []  # this -m launch's points, each its overrides, in the order Hydra runs them


class SweepPoints(Callback):
    """Notes the points of a -m launch as Hydra's basic sweeper makes them: its params, then the command's overrides,
    each sweep a product."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # (its own expansion, not a copy)

        POINTS.clear()
        if not str(config.hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"):  # another sweeper's own way
            return
        params = config.hydra.sweeper.get("params")
        params = OmegaConf.to_container(params, resolve=False) if isinstance(params, DictConfig) else {}
        arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())  # (glob(*) of a group)
        try:  # a callback's error would only be Hydra's warning, on every launch: each point is checked as it starts
            batches = BasicSweeper.split_arguments(parser.parse_overrides(arguments), None)
        except Exception:  # noqa: BLE001
            batches = []
        POINTS.extend(list(point) for batch in batches for point in batch)


def check_every_point(check: Callable[[DictConfig, Path, list[str]], None]) -> None:
    """At a sweep's first point: `check` (which raises ConfigError) each point's config, with its run dir and its
    overrides; a refusal names the point."""
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN or hydra.job.num != 0 or len(POINTS) < 2:
        return
    if str(hydra.sweep.subdir) != "0":  # a subdir of the user's own: the points' run dirs are not <sweep dir>/<num>
        return
    shared = set.intersection(*(set(point) for point in POINTS))  # a point is named by what it sweeps
    for num, point in enumerate(POINTS):
        try:
            check(compose(config_name=hydra.job.config_name, overrides=point), Path(hydra.sweep.dir) / str(num), point)
        except ConfigError as err:
            swept = " ".join(override for override in point if override not in shared)
            raise ConfigError(f"sweep point #{num} ({swept}): {err}; no point of the sweep ran (fix that value, or "
                              f"leave it out of the sweep)") from None
