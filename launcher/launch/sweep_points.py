"""Every point of a -m sweep checked before the first one runs.

Hydra's basic launcher runs a local sweep's points one after the other, and each point's checks ran as it started:
`-m train.global_batch_size=32,30` trained point 0 to its end, then refused point 1 (30 does not divide), hours
into a real sweep. Hydra composes every point up front (its keys); the launcher's own checks (the plan, the
optimizer's values, the job's inputs) now run for every point at the first one, and a refused point stops the
sweep before any trained. (A Slurm sweep was whole already: its points are submitted once all are checked.)
Hydra's launcher says "Launching N jobs locally" and "#0 : <overrides>" before point 0's task runs those checks;
a refused sweep then read as if point 0 had started. Its first line says "Checking" instead, and the "#0" line is
held back until the checks pass. A point that fails as it trains does not end a local sweep (it ended it, with the
points after it never run and nothing said of them): the sweep goes on, and its end names the failed points. A stop
(Ctrl-C, a preemption) still ends it. Exercised by: tests/test_cli.py, tests/test_sweep_failures.py.
"""
from __future__ import annotations

import logging
import sys
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
from launcher.preempt import REQUEUE_EXIT_CODE

POINTS: list[list[str]] = []  # this -m launch's points, each its overrides, in the order Hydra runs them
HELD: list[tuple[logging.Handler, logging.LogRecord]] = []  # Hydra's "#0 : ..." line, until the points pass
FAILED: list[tuple[str, int, str]] = []  # this local sweep's points that failed as they trained: (words, code, sweep dir)
LOGGER = "hydra._internal.core_plugins.basic_launcher"


class SweepPoints(Callback, logging.Filter):
    """Notes the points of a -m launch as Hydra's basic sweeper makes them: its params, then the command's overrides,
    each sweep a product; and, for a local sweep of several, words Hydra's launcher's lines as what happens."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # (its own expansion, not a copy)

        POINTS.clear()
        HELD.clear()
        FAILED.clear()
        self.holding = False
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
        if len(POINTS) > 1:  # (launcher=slurm's first line: slurm_submit.ArrayWords)
            self.holding = True
            self.local = config.launcher.name != "slurm"
            logging.getLogger(LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        if self.local and said.startswith("Launching ") and said.endswith(" jobs locally"):
            points = said.removeprefix("Launching ").removesuffix(" jobs locally")
            record.msg, record.args = f"Checking {points} sweep points, then running them here one after the other", ()
        if self.holding and said.startswith("\t#0 : "):  # shown by the handlers of now (Hydra's), once checked
            self.holding = False
            HELD.extend((handler, record) for handler in logging.getLogger().handlers)
            return False
        return True


def show_held() -> None:
    """Hydra's "#0 : <overrides>" line, once the sweep's points passed their checks."""
    for handler, record in HELD:
        handler.handle(record)
    HELD.clear()


def check_every_point(check: Callable[[DictConfig, Path, list[str]], None]) -> None:
    """At a sweep's first point: `check` (which raises ConfigError) each point's config, with its run dir and its
    overrides; a refusal names the point."""
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN or hydra.job.num != 0 or len(POINTS) < 2:
        return
    if str(hydra.sweep.subdir) != "0":  # a subdir of the user's own: the points' run dirs are not <sweep dir>/<num>
        show_held()
        return
    for num, point in enumerate(POINTS):
        try:
            check(compose(config_name=hydra.job.config_name, overrides=point), Path(hydra.sweep.dir) / str(num), point)
        except ConfigError as err:
            HELD.clear()
            raise ConfigError(f"sweep point #{num} ({_swept(num)}): {err}; no point of the sweep ran (fix that value, "
                              f"or leave it out of the sweep)") from None
    show_held()


def _swept(num: int) -> str:
    """Point `num`'s overrides that the sweep's points do not share: what names it (what it sweeps)."""
    shared = set.intersection(*(set(point) for point in POINTS))
    return " ".join(override for override in POINTS[num] if override not in shared)


def goes_on_after(run_dir: Path, code: int, nnodes: int) -> bool:
    """Whether a local sweep goes on to its next point after this one's workers ended with `code` (their line said
    why): a failure, in a sweep of Hydra's basic sweeper of several points on one node, noted for the sweep's end.
    A stop ends the sweep (REQUEUE_EXIT_CODE: Ctrl-C, a preemption; over 128: the agent's SIGHUP or SIGQUIT), as do a
    single run, another sweeper's (it reads each point's result), and several nodes (one whose rendezvous failed
    would meet the others at a later point)."""
    hydra = HydraConfig.get()
    if code == REQUEUE_EXIT_CODE or code > 128 or hydra.mode != RunMode.MULTIRUN or len(POINTS) < 2 or nnodes > 1:
        return False
    num = hydra.job.num
    named = f" ({_swept(num)})" if num < len(POINTS) else ""
    FAILED.append((f"#{num}{named}, run dir {run_dir}", code, str(Path(hydra.sweep.dir).absolute())))
    return True


def failed_points_code() -> int:
    """The exit code of a sweep whose failed points went on: theirs where they all share one (76: relaunch, at half
    the micro-batch), else 1; 0 where none failed."""
    codes = {code for _, code, _ in FAILED}
    return (codes.pop() if len(codes) == 1 else 1) if codes else 0


def tell_failed_points() -> None:
    """The sweep's last line: the points that failed (each said why as it ended), whether the sweep ran on to its end
    or a later point's stop ended it."""
    if FAILED:
        print(f"error: {len(FAILED)} of {len(POINTS)} sweep points failed: {'; '.join(s for s, _, _ in FAILED)}; the "
              f"sweep's command with hydra.sweep.dir={FAILED[0][2]} runs them again and skips the finished",
              file=sys.stderr, flush=True)
        FAILED.clear()
