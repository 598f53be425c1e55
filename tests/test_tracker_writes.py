"""A log step does not wait for MLflow's store: rank 0 hands the write to MLflow's logging thread, and
the write's failure shows one log later, as one warning that turns the tracker off; a failed last write
still ends the run. Real MLflow on its embedded SQLite store, held locked by a second connection the way a
busy store or a slow server holds it, or with a file where its artifact dir would be."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import run_cli
from helpers import ONE, TOY, with_store
from launcher.track.mlflow_tracker import MlflowTracker
from launcher.track.protocol import Resume
from launcher.track.trackers import Trackers

if TYPE_CHECKING:  # an optional package, imported where used: `pytest -m gpu` collects this file without it
    from mlflow import MlflowClient

pytestmark = pytest.mark.slow


def open_tracker(cwd: Path, empty_store: Path) -> tuple[MlflowClient, MlflowTracker]:
    client = with_store(cwd, empty_store)
    experiment = client.create_experiment("toy")
    run_id = client.create_run(experiment).info.run_id
    uri = f"sqlite:///{cwd / 'runs' / 'mlflow.db'}"
    tracker = MlflowTracker(cwd, {"name": "toy"}, {"tracking_uri": uri}, {"run_id": run_id}, Resume(0, False))
    return client, tracker


def points(db: sqlite3.Connection, run_id: str) -> list[tuple[str, int, float]]:
    return db.execute("SELECT key, step, value FROM metrics WHERE run_uuid = ? ORDER BY step",
                      (run_id,)).fetchall()


def test_a_log_returns_before_the_store_has_written_it(tmp_path: Path, empty_store: Path) -> None:
    client, tracker = open_tracker(tmp_path, empty_store)
    db = sqlite3.connect(tmp_path / "runs" / "mlflow.db", isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")  # nobody else writes (or reads) until this connection lets go
    try:
        tracker.log(5, {"loss": 0.25}, "train")  # with a synchronous write, this line waits for the lock
        assert points(db, tracker.run_id) == []  # returned, and the store has nothing yet
    finally:
        db.execute("COMMIT")
    tracker.log(10, {"loss": 0.125}, "eval")  # waits for the step-5 write first (done by now, or soon)
    tracker.close()
    assert points(db, tracker.run_id) == [("loss", 5, 0.25), ("eval/loss", 10, 0.125)]
    db.close()


def test_a_failed_write_turns_mlflow_off_at_the_next_log_with_one_warning(tmp_path: Path, empty_store: Path,
                                                                         capfd: pytest.CaptureFixture) -> None:
    client, tracker = open_tracker(tmp_path, empty_store)
    warnings: list[str] = []
    trackers = Trackers(warnings.append)
    trackers.add("mlflow", lambda: tracker)
    client.delete_run(tracker.run_id)  # MLflow refuses points for a deleted run: the write fails in its thread
    trackers.call("log", 5, {"loss": 0.25}, "train")
    assert warnings == [] and trackers.active == [tracker]  # the failure is not known yet
    trackers.call("log", 10, {"loss": 0.125}, "train")
    assert len(warnings) == 1 and trackers.active == []
    assert warnings[0].startswith("warning: mlflow failed (MlflowException:") and "deleted" in warnings[0]
    trackers.call("log", 15, {"loss": 0.0625}, "train")  # off for the rest of this start: nothing more
    assert len(warnings) == 1
    # ... and only that warning: MLflow's own error line would show the request's URL, credentials and all
    assert "Failed to log run data" not in capfd.readouterr().err


def test_a_failed_last_write_still_ends_the_mlflow_run(tmp_path: Path, empty_store: Path) -> None:
    """Uploading the artifacts at the end fails (a file stands where the store's artifact dir would be): the
    run warns once, exits 0, and its MLflow run says FINISHED, not RUNNING forever; the metrics are there."""
    client = with_store(tmp_path, empty_store)
    (tmp_path / "runs" / "mlartifacts").write_text("not a directory")
    run_dir = tmp_path / "run"
    out = run_cli(*TOY, ONE, "logger=[mlflow]", "logger.mlflow.artifacts=true", f"hydra.run.dir={run_dir}",
                  cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("warning: mlflow failed (NotADirectoryError") == 1, out.stderr[-3000:]  # what failed
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments() if e.name == "toy"])
    assert run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss")} == {5, 10, 15, 20}
