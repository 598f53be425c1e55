"""MLflow: one run per training run, reopened by every start of its workers; a sweep's points are the
children of one parent run. Embedded by default (a SQLite store under runs/), or any tracking server.

The parent opens the run (open_run: a store that cannot be reached stops the launch in one line) and logs
the config as params; rank 0 reopens it by id (MlflowTracker) and logs what metrics.jsonl gets. MLflow
cannot delete logged points: after a crash-resume from step S the steps after S are logged again, and the
latest value of each step (by timestamp) is the one of the final weights, as in metrics.jsonl.
Exercised by: `python -m launcher +exp=toy logger=[tensorboard,mlflow]`, then
`mlflow ui --backend-store-uri sqlite:///runs/mlflow.db` (the UI needs the full `pip install mlflow`).
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator

from launcher.redact import REDACTED, redact, redacted
from launcher.derived import ConfigError
from launcher.derived import NOT_TRAJECTORY
from launcher.track.protocol import PACKAGES, Resume, Tracker, flat_params, run_tags, summary_scalars

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests a sweep's points under their parent run
BATCH = 100  # MLflow takes at most 100 params per log_batch call
# Tags of ours, in MLflow's own names where it has one (the UI shows the commit).
TAG_NAMES = {"git_sha": "mlflow.source.git.commit", "exp": "launcher.exp", "world_size": "launcher.world_size",
             "precision": "launcher.precision", "slurm_job_id": "launcher.slurm_job_id"}
# A server that does not answer costs the launch seconds, not MLflow's default minutes of retries;
# during training, at most about a minute once (then the tracker is off until the next start).
PARENT_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
WORKER_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def tracking_uri(settings: dict[str, Any]) -> str:
    """The store to use. A URI with credentials is kept out of config.yaml (it holds it redacted): the
    parent passes the real one to its workers in MLFLOW_TRACKING_URI."""
    uri = settings["tracking_uri"]
    if REDACTED in uri:
        if "MLFLOW_TRACKING_URI" not in os.environ:
            raise RuntimeError("the tracking URI holds credentials, which config.yaml does not keep; set "
                               "MLFLOW_TRACKING_URI for the workers")
        return os.environ["MLFLOW_TRACKING_URI"]
    return uri


def _client(uri: str) -> Any:
    # No usage telemetry from the launcher's processes (it sends to MLflow's servers, and each process
    # waits for it at exit), unless the user asks for it.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # Ending a run prints its URL, and for a server that is the tracking URI, credentials and all
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    try:
        import mlflow
        from mlflow import MlflowClient
    except ImportError:
        raise ConfigError(f"logger=mlflow needs the mlflow package: pip install {PACKAGES['mlflow']} (or "
                          f"pip install -e '.[mlflow]'), or drop mlflow from logger=[...]") from None
    for name in ("mlflow", "alembic"):  # its INFO lines (creating tables, migrations) are not ours to show
        logging.getLogger(name).setLevel(logging.WARNING)
    # A failed background write is logged there with the request's URL, credentials and all; the tracker
    # raises it at the next log, where Trackers warns once, redacted
    logging.getLogger("mlflow.utils.async_logging").setLevel(logging.CRITICAL)
    del mlflow  # imported to fail early, with the install hint, when only part of it is there
    return MlflowClient(uri)


@contextmanager
def _env_defaults(values: dict[str, str]) -> Iterator[None]:
    """MLflow's HTTP limits for a while, unless the user set them."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _why(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return redact("", f"{type(err).__name__}: {lines[0][:300] if lines else ''}")


def check_store(config: dict[str, Any], settings: dict[str, Any]) -> tuple[Any, str]:
    """Reach the store and find (or make) the experiment: (client, experiment id), or ConfigError."""
    uri, shown = tracking_uri(settings), redact("", settings["tracking_uri"])
    name = settings.get("experiment") or config["name"]
    with _env_defaults(PARENT_HTTP):
        try:
            client = _client(uri)
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                experiment_id = _create_experiment(client, name, uri)
            elif experiment.lifecycle_stage == "deleted":
                raise ConfigError(f"MLflow experiment {name} is deleted in {shown}; restore it (mlflow "
                                  f"experiments restore --experiment-id {experiment.experiment_id}) or set "
                                  f"logger.mlflow.experiment")
            else:
                experiment_id = experiment.experiment_id
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(f"logger.mlflow.tracking_uri={shown} cannot be used ({_why(err)}); start the server, "
                              f"fix the URI, or drop mlflow from logger=[...]") from None
    return client, experiment_id


def _create_experiment(client: Any, name: str, uri: str) -> str:
    """A new experiment; in a local store its artifacts go next to the database, not into the cwd."""
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # made at the same moment by another launch
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def open_run(client: Any, experiment_id: str, config: dict[str, Any], entry: dict[str, Any] | None, name: str,
             parent_run_id: str | None) -> dict[str, Any]:
    """The run of this run dir: the recorded one if the store has it, else a new one with the config as
    params. Returns its trackers.json entry."""
    run = None
    if entry:
        try:
            run = client.get_run(entry["run_id"])
        except Exception:  # another store, or the run was deleted there: a new run
            print(f"note: MLflow run {entry['run_id']} of this run dir is not in this store; starting a new one",
                  flush=True)
    if run is None or run.info.lifecycle_stage == "deleted":
        tags = {PARENT_TAG: parent_run_id} if parent_run_id else {}
        run = client.create_run(experiment_id, run_name=name, tags=tags)
    _log_params(client, run, flat_params({k: v for k, v in config.items() if k != "plan"}))
    return {"run_id": run.info.run_id, "experiment_id": experiment_id, "parent_run_id": parent_run_id}


def _log_params(client: Any, run: Any, params: dict[str, str]) -> None:
    """Params are write-once in MLflow: a relaunch adds the new keys; a changed value (a resume with
    resume.allow_config_change=true) keeps its first value, and a note says which."""
    from mlflow.entities import Param

    logged = run.data.params
    changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v[:6000]
                     and k.split(".")[0] not in NOT_TRAJECTORY)  # where and how it runs may change by design
    new = [Param(k, v[:6000]) for k, v in params.items() if k not in logged]  # MLflow's limit on a value
    for first in range(0, len(new), BATCH):
        client.log_batch(run.info.run_id, params=new[first:first + BATCH])
    if changed:
        print(f"note: MLflow keeps the first value of params {', '.join(changed)} (they changed since this run "
              f"started)", flush=True)


def open_sweep_run(client: Any, experiment_id: str, run_id: str | None, name: str) -> str:
    """The parent run of a -m sweep: the recorded one if the store has it, else a new one."""
    if run_id:
        try:
            return client.get_run(run_id).info.run_id
        except Exception:
            pass
    return client.create_run(experiment_id, run_name=name, tags={"launcher.sweep": "true"}).info.run_id


def parent_http_limits() -> Any:
    """The parent's MLflow HTTP limits (no retries, 15 s), unless the user set them."""
    return _env_defaults(PARENT_HTTP)


def end_run(uri: str, run_id: str, status: str) -> None:
    with parent_http_limits():
        _client(uri).set_terminated(run_id, status)


class MlflowTracker(Tracker):
    """Rank 0's side: reopen the run by id, log each logged step's scalars, end it (with logger.mlflow.artifacts:
    the config, redacted, summary.json and the final checkpoint as the run's artifacts)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict[str, Any], settings: dict[str, Any], entry: dict[str, Any],
                 resume: Resume):
        for key, value in WORKER_HTTP.items():  # this process only: rank 0 of this run
            os.environ.setdefault(key, value)
        uri = tracking_uri(settings)
        from mlflow.entities import Metric, RunTag

        self._metric, self.run_dir, self.settings, self.config = Metric, run_dir, settings, config
        self.client, self.run_id, self._pending = _client(uri), entry["run_id"], None
        self.client.update_run(self.run_id, status="RUNNING")
        tags = {TAG_NAMES[k]: v for k, v in run_tags(run_dir, config).items()}
        if resume.lost:  # the steps after it are logged again: the latest value of a step is the one that counts
            tags["launcher.relogged_after_step"] = str(resume.step)
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log(self, step: int, scalars: dict[str, float], kind: str) -> None:
        """Handed to MLflow's logging thread: a log step does not wait for the store (a server's round
        trip, a SQLite commit), and the other ranks do not wait for rank 0 in the next collective."""
        self.settle()
        now = int(time.time() * 1000)
        prefix = "" if kind == "train" else f"{kind}/"
        self._pending = self.client.log_batch(self.run_id, metrics=[self._metric(f"{prefix}{k}", float(v), now, step)
                                                                    for k, v in scalars.items()], synchronous=False)

    def settle(self) -> None:
        """Wait for the last log's write, long done at the next log step; its failure is raised here, one
        log late, and Trackers turns this tracker off."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def finish(self, summary: dict[str, Any]) -> None:
        try:
            self.settle()
            now, step = int(time.time() * 1000), summary["steps"]
            self.client.log_batch(self.run_id, metrics=[self._metric(f"summary/{k}", float(v), now, step)
                                                        for k, v in summary_scalars(summary).items()])
            if summary.get("checkpoint"):
                self.client.set_tag(self.run_id, "launcher.checkpoint", summary["checkpoint"])
            if self.settings.get("artifacts"):  # the config without its secrets (setup lines may export some)
                self.client.log_dict(self.run_id, redacted("", self.config), "config.yaml")
                self.client.log_artifact(self.run_id, str(self.run_dir / "summary.json"))
                if summary.get("checkpoint"):
                    self.client.log_artifacts(self.run_id, summary["checkpoint"], "checkpoint")
        except Exception:  # the training is done all the same: the run says so; Trackers warns with this error
            self._end_anyway("FINISHED")
            raise
        self.client.set_terminated(self.run_id, "FINISHED")

    def preempted(self, step: int) -> None:
        try:
            self.settle()
        except Exception:
            self._end_anyway("KILLED")
            raise
        self.client.set_terminated(self.run_id, "KILLED")  # RUNNING again when the requeued job starts

    def _end_anyway(self, status: str) -> None:
        """The run's status after a failed write, not RUNNING forever; where the store is gone as well, the
        first error is the one the warning names."""
        with suppress(Exception):
            self.client.set_terminated(self.run_id, status)

    def close(self) -> None:
        self.settle()  # (after a crash RunLog does not close: MLflow's exit handler writes the last point)
