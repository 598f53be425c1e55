"""Open the tracker runs in the parent, before any worker starts.

A tracker that cannot start (its package missing, a bad URI, a server down, a W&B login refused) stops the
launch here in one line naming the key, and no run dir is left. A run dir's tracker runs are recorded in
<run_dir>/trackers.json, which every start of its workers reads. A -m sweep gets one MLflow parent run and
one W&B group, recorded in <sweep_dir>/trackers.json; the parent run ends once every point ran (local) or
was submitted (Slurm): end_sweeps, from launcher/__main__.py.
Exercised by: `python -m launcher -m +exp=toy logger=[tensorboard,mlflow] train.seed=0,1`.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from launcher.redact import REDACTED, URL_CREDENTIALS, URL_QUERY_SECRET, redact, redact_override
from launcher.derived import ConfigError
from launcher.track import mlflow_tracker, wandb_tracker
from launcher.track.protocol import PACKAGES, enabled, read_record, write_record


@dataclass(frozen=True)
class Point:
    """What the tracker runs of one launch are called, and the sweep it belongs to (-m), if any."""

    name: str
    sweep_dir: Path | None


@dataclass
class Sweep:
    record: dict[str, Any]  # what <sweep_dir>/trackers.json holds
    mlflow: tuple[Any, str] | None = None  # (client, parent run id) to end when the sweep is done


SWEEPS: dict[Path, Sweep] = {}  # every point of a sweep runs (or is queued) in this one process


def hydra_point(run_dir: Path) -> Point:
    """Named after the run dir; a sweep point after its number and overrides (secrets redacted)."""
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return Point(run_dir.name, None)
    overrides = " ".join(redact_override(arg) for arg in hydra.overrides.task)
    return Point(f"{hydra.job.num}: {overrides}"[:250], Path(hydra.sweep.dir).resolve())


def settle_uris(config: dict[str, Any], record_dirs: list[Path]) -> None:
    """In the resolved config (config.yaml): the embedded store's path made absolute (a Slurm job may start
    elsewhere), and a URI's credentials replaced by <redacted> (the workers get the real URI from
    MLFLOW_TRACKING_URI, set here), so they reach neither the run dir nor a tracker; Hydra's own record of
    the command line in `record_dirs` (.hydra/, multirun.yaml) loses them too."""
    settings = (config.get("logger") or {}).get("mlflow")
    if settings is None:
        return
    uri = settings["tracking_uri"]
    if not uri:
        raise ConfigError("logger.mlflow.tracking_uri is empty; give a tracking server's URI, or leave it out for "
                          "the embedded store sqlite:///runs/mlflow.db")
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
    shown = redact("", uri)
    if shown != uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri  # inherited by the local workers and the Slurm jobs
        secrets = [m.group(0)[3:-1] for m in URL_CREDENTIALS.finditer(uri)]  # "://user:password@" -> the middle
        secrets += [m.group(0)[len(m.group(1)):] for m in URL_QUERY_SECRET.finditer(uri)]
        _scrub(record_dirs, secrets)
    settings["tracking_uri"] = shown


def _scrub(record_dirs: list[Path], secrets: list[str]) -> None:
    """Hydra wrote the command line into the run dir (and a sweep's dir) before our code ran."""
    for folder in record_dirs:
        for path in [*folder.glob(".hydra/*.yaml"), folder / "multirun.yaml"]:
            text = path.read_text() if path.is_file() else ""
            if any(secret in text for secret in secrets):
                for secret in secrets:
                    text = text.replace(secret, REDACTED)
                path.write_text(text)


def start_trackers(run_dir: Path, config: dict[str, Any], point: Point, dry_run: bool) -> dict[str, Any] | None:
    """Check and open the tracker runs of this run dir; returns trackers.json's content (None: nothing to
    record). Raises ConfigError before anything is made when a tracker cannot start."""
    settle_uris(config, [run_dir, *([point.sweep_dir] if point.sweep_dir else [])])
    loggers = {name: settings for name, settings in enabled(config) if name != "tensorboard"}
    if not loggers:
        return None
    if dry_run:  # check, start nothing: no store is touched, no run made
        for name in loggers:
            if importlib.util.find_spec(name) is None:
                raise ConfigError(f"logger={name} needs the {name} package: pip install {PACKAGES[name]}, or drop "
                                  f"{name} from logger=[...]")
        return None
    store = None
    if "mlflow" in loggers:  # every check first: a failing one leaves no tracker run behind
        settings = loggers["mlflow"]
        if settings["tracking_uri"].startswith("sqlite:////"):  # the embedded store's folder (runs/)
            folder = Path(settings["tracking_uri"].removeprefix("sqlite:///")).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"logger.mlflow.tracking_uri: cannot make the SQLite store's folder {folder} "
                                  f"({err.strerror}); point it at a writable path") from None
        store = mlflow_tracker.check_store(config, settings)
    if "wandb" in loggers:
        wandb_tracker.check_login(loggers["wandb"])
    try:  # a store that answered the check may still refuse to write (a read-only database)
        sweep = _sweep(point, config, store)
        record = read_record(run_dir)
        if store:
            parent = sweep.record["mlflow"]["run_id"] if sweep else None
            record["mlflow"] = mlflow_tracker.open_run(*store, config, record.get("mlflow"), point.name, parent)
            record["mlflow"]["tracking_uri"] = loggers["mlflow"]["tracking_uri"]
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"logger.mlflow.tracking_uri={redact('', loggers['mlflow']['tracking_uri'])}: cannot open "
                          f"the MLflow run ({type(err).__name__}: {redact('', str(err).splitlines()[0][:200])}); "
                          f"check the store, or drop mlflow from logger=[...]") from None
    if "wandb" in loggers:
        group = sweep.record["wandb"]["group"] if sweep else None
        record["wandb"] = wandb_tracker.open_run(record.get("wandb"), point.name, group)
        where = (f"offline under {run_dir / 'wandb'} (upload: wandb sync {run_dir / 'wandb'}/offline-run-*)"
                 if loggers["wandb"]["mode"] == "offline" else "online")
        print(f"wandb: run {record['wandb']['id']}, {where}", flush=True)
    if store:
        uri = loggers["mlflow"]["tracking_uri"]
        # .[dev] installs mlflow-skinny, the client: its `mlflow ui` fails for want of the server (flask)
        ui = f" (UI: pip install mlflow, then mlflow ui --backend-store-uri {uri})" if uri.startswith("sqlite:") else ""
        print(f"mlflow: run {record['mlflow']['run_id']} in {uri}{ui}", flush=True)
    return record


def _sweep(point: Point, config: dict[str, Any], store: tuple[Any, str] | None) -> Sweep | None:
    """The sweep of this point: made at its first point, reopened from <sweep_dir>/trackers.json when a
    sweep is launched again into the same dir."""
    if point.sweep_dir is None:
        return None
    sweep = SWEEPS.get(point.sweep_dir)
    if sweep is None:
        sweep = SWEEPS[point.sweep_dir] = Sweep(read_record(point.sweep_dir))
    record = sweep.record
    if store and sweep.mlflow is None:
        client, experiment_id = store
        run_id = mlflow_tracker.open_sweep_run(client, experiment_id, (record.get("mlflow") or {}).get("run_id"),
                                               f"sweep {point.sweep_dir.name}")
        record["mlflow"], sweep.mlflow = {"run_id": run_id}, (client, run_id)
    record.setdefault("wandb", {"group": f"{config['name']}-{point.sweep_dir.name}"})
    point.sweep_dir.mkdir(parents=True, exist_ok=True)
    write_record(point.sweep_dir, record)
    return sweep


def end_sweeps(failed: bool) -> None:
    """End the MLflow parent run of each sweep of this process (its points ran, or were submitted)."""
    for sweep in SWEEPS.values():
        if sweep.mlflow:
            client, run_id = sweep.mlflow
            try:
                with mlflow_tracker.parent_http_limits():  # a server gone meanwhile: fail fast, not retry for minutes
                    client.set_terminated(run_id, "FAILED" if failed else "FINISHED")
            except Exception as err:
                print(f"warning: could not end the sweep's MLflow run {run_id} ({type(err).__name__})",
                      file=sys.stderr)
    SWEEPS.clear()


def mark_failed(run_dir: Path, config: dict[str, Any], code: int) -> None:
    """The workers failed (a SIGKILLed rank 0 could not say so): the MLflow run ends FAILED (KILLED after a
    signal), not RUNNING."""
    entry = read_record(run_dir).get("mlflow")
    if entry and "mlflow" in dict(enabled(config)):  # not a run of an earlier launch that logged to MLflow
        try:
            status = "KILLED" if code > 128 else "FAILED"
            mlflow_tracker.end_run(mlflow_tracker.tracking_uri(entry), entry["run_id"], status)
        except Exception:
            pass  # the launch's own error line is what matters here
