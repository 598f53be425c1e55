"""What a log step costs rank 0 in MLflow: a synchronous log_batch (how the launcher logged before) against
the tracker's handover to MLflow's logging thread (launcher/track/mlflow_tracker.py), on the embedded SQLite store.

Per mode: the median and max milliseconds that a log call holds the training loop, over log steps
`--gap` seconds apart (the training between them), 14 scalars each (a launcher log record's size).
A server adds its round trip to the synchronous time and nothing to the handover.
Run: python bench/tracker_log.py [--logs 40] [--gap 0.05]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
from launcher.track.mlflow_tracker import MlflowTracker  # noqa: E402
from launcher.track.protocol import Resume  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logs", type=int, default=40)
    parser.add_argument("--gap", type=float, default=0.05, help="seconds of training between two log steps")
    args = parser.parse_args()
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(uri)
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        run_id = client.create_run(client.create_experiment("bench")).info.run_id
        tracker = MlflowTracker(Path(tmp), {"name": "bench"}, {"tracking_uri": uri}, {"run_id": run_id},
                                Resume(0, False))
        scalars = {f"metric_{i}": float(i) for i in range(14)}

        def synchronous(step: int) -> None:
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()],
                             synchronous=True)

        def handed_over(step: int) -> None:
            tracker.log(step, scalars, "train")

        results = {}
        for name, log in (("synchronous log_batch", synchronous), ("launcher's MlflowTracker.log", handed_over)):
            held = []
            for step in range(args.logs):
                started = time.perf_counter()
                log(step)
                held.append((time.perf_counter() - started) * 1000)
                time.sleep(args.gap)
            results[name] = held[1:]  # the first starts MLflow's logging thread
        tracker.close()
    print(f"MLflow embedded SQLite store, {args.logs} log steps {args.gap * 1000:.0f} ms apart, 14 scalars each:")
    for name, held in results.items():
        print(f"  {name}: median {statistics.median(held):.2f} ms, max {max(held):.2f} ms per log step")


if __name__ == "__main__":
    main()
