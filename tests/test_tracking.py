"""Experiment tracking that survives requeues (issue 14): MLflow's embedded store and W&B offline, read
back with their own libraries and files; one tracker run per training run through a killed rank, a
preemption and a relaunch; a sweep's parent run; no secret in a store; a bad URI stops the launch."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import on_the_cpu_plan, read_metrics, run_cli, subprocess_env
from helpers import ONE, TOY, logged_step, store, wait_until, with_store, worker_pid
from launcher.preempt import REQUEUE_EXIT_CODE
from launcher.track.protocol import Tracker, flat_params
from launcher.track.trackers import Trackers

if TYPE_CHECKING:  # optional packages, imported where used: `pytest -m gpu` collects this file without them
    from mlflow import MlflowClient
    from wandb.proto import wandb_internal_pb2

pytestmark = pytest.mark.slow
SECRETS = {"WANDB_API_KEY": "wb-secret-0123456789", "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-42",
           "MLFLOW_TRACKING_USERNAME": "alice-secret-user"}
SETUP_SECRET = "hf-setup-secret-77"  # in a launcher.setup line: config.yaml needs it (Slurm runs it), no tracker does


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def latest_per_step(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    """MLflow cannot delete points: a step logged again counts with its latest value."""
    latest: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in latest or m.timestamp >= latest[m.step][0]:
            latest[m.step] = (m.timestamp, m.value)
    return {step: value for step, (_, value) in latest.items()}


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data, records, chunk, pos = path.read_bytes(), [], b"", 7  # after the ":W&B" header, version and magic
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
        elif kind == 0:
            break
    return records


def wandb_starts(run_dir: Path) -> list[dict]:
    """Each start of rank 0 wrote one offline run: its id, its rewind step (if any), and its history."""
    starts = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        records = wandb_records(path)
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                   for r in records if r.WhichOneof("record_type") == "history"]
        starts.append({"id": run.run_id, "group": run.run_group, "tags": list(run.tags), "resumed": run.resume,
                       "rewind": run.branch_point.value if run.HasField("branch_point") else None,
                       "history": history, "bytes": path.read_bytes()})
    return starts


def replay(starts: list[dict]) -> dict[int, float]:
    """What W&B's server holds once the offline runs are synced in order: a rewind to step S drops the
    steps after S, then the start's own steps follow."""
    loss: dict[int, float] = {}
    for start in starts:
        if start["rewind"] is not None:
            loss = {step: value for step, value in loss.items() if step <= start["rewind"]}
        loss.update({row["_step"]: row["loss"] for row in start["history"] if "loss" in row})
    return loss


def test_mlflow_gets_one_run_with_the_config_the_metrics_and_the_tags(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = on_the_cpu_plan([*TOY, "logger=[tensorboard,mlflow]", f"launcher.setup=['export HF_TOKEN={SETUP_SECRET}']",
                            f"hydra.run.dir={run_dir}"])
    out = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=tmp_path, env=subprocess_env(**SECRETS),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    client = store(tmp_path)
    (experiment,) = [e for e in client.search_experiments() if e.name == "toy"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch_size"] == "32" and run.data.params["name"] == "toy"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [5, 10, 15, 20]  # one point per logged step
    assert {m.step: m.value for m in history} == pytest.approx(losses(run_dir), rel=1e-6)
    evals = {m["step"]: m["eval"]["loss"] for m in read_metrics(run_dir) if "eval" in m}
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")} == pytest.approx(evals)
    assert {"lr", "grad_norm", "samples_per_sec", "summary/final_loss", "summary/wall_time_s"} <= set(run.data.metrics)
    tags = run.data.tags
    launch = json.loads((run_dir / "launch.json").read_text())
    assert tags["launcher.exp"] == "toy" and tags["launcher.world_size"] == "2" and tags["launcher.precision"] == "fp32"
    assert tags["mlflow.source.git.commit"] == launch["git"]["revision"]
    assert tags["launcher.checkpoint"] == str(run_dir / "checkpoints" / "20")
    assert (run_dir / "tb").is_dir()  # tensorboard is still on
    assert "<redacted>" in run.data.params["launcher.setup"]
    text = (tmp_path / "runs" / "mlflow.db").read_bytes().decode("latin-1")
    for secret in [*SECRETS.values(), SETUP_SECRET]:  # the store is greppable: no secret in it
        assert secret not in text and secret not in out.stdout + out.stderr


def test_a_killed_rank_a_preemption_and_a_relaunch_continue_one_tracker_run(tmp_path: Path, empty_store: Path) -> None:
    """Rank 1 is SIGKILLed after step 20's checkpoint (torchrun restarts the group: steps after 20 are
    logged again), then the launcher is preempted, then relaunched into the same run dir: one MLflow run
    whose latest value per step is metrics.jsonl's, and one W&B run id whose rewinds give the same."""
    run_dir = tmp_path / "run"
    args = on_the_cpu_plan(["+exp=toy", "train.max_steps=60", "train.log_every=1", "train.eval_every=0",
                            "train.ckpt_every=20", "train.global_batch_size=16", "train.micro_batch_size=4",
                            "data.sleep_s=0.03", "launcher.max_restarts=1", "logger=[tensorboard,mlflow,wandb]",
                            f"hydra.run.dir={run_dir}"])

    def launch() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=tmp_path, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    client = with_store(tmp_path, empty_store)
    proc = launch()
    wait_until(lambda: (run_dir / "checkpoints" / "20" / "COMPLETE").exists() and logged_step(run_dir) >= 23)
    os.kill(worker_pid(proc.pid, rank=1), signal.SIGKILL)
    wait_until(lambda: logged_step(run_dir) >= 30)  # restarted from step 20, and past it again
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, err[-3000:]
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert run.info.status == "KILLED"  # preempted: waiting for its requeue
    relaunch = launch()
    _, err = relaunch.communicate(timeout=300)
    assert relaunch.returncode == 0, err[-3000:]

    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])  # still ONE run
    assert run.info.status == "FINISHED"
    expected = losses(run_dir)
    assert sorted(expected) == list(range(1, 61))
    history = client.get_metric_history(run.info.run_id, "loss")
    assert len(history) > 60  # the lost steps after 20 were logged twice ...
    assert latest_per_step(client, run.info.run_id, "loss") == pytest.approx(expected, rel=1e-6)  # ... latest wins
    assert run.data.tags["launcher.relogged_after_step"] == "20"

    starts = wandb_starts(run_dir)
    assert len(starts) == 3 and len({s["id"] for s in starts}) == 1  # three starts, one W&B run
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"] == starts[0]["id"]
    assert starts[1]["rewind"] == 20  # the restart rewound the run to its checkpoint's step
    assert starts[2]["rewind"] is None  # the preemption lost no step: the relaunch simply resumes the run
    assert replay(starts) == pytest.approx(expected, rel=1e-6)


def test_a_sweep_is_one_parent_run_with_a_child_per_point(tmp_path: Path, empty_store: Path) -> None:
    sweep_dir, client = tmp_path / "sweep", with_store(tmp_path, empty_store)
    out = run_cli("-m", "+exp=toy", ONE, "train.max_steps=5", "train.log_every=5", "logger=[mlflow,wandb]",
                  "train.seed=0,1", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(children) == 2
    assert parent.info.status == "FINISHED" and all(c.info.status == "FINISHED" for c in children)
    assert sorted(c.data.params["train.seed"] for c in children) == ["0", "1"]
    assert json.loads((sweep_dir / "trackers.json").read_text())["mlflow"]["run_id"] == parent.info.run_id
    groups = {s["group"] for point in ("0", "1") for s in wandb_starts(sweep_dir / point)}
    assert groups == {f"toy-{sweep_dir.name}"}  # W&B: the sweep's points share one group


def test_wandb_offline_holds_the_history_a_resume_reuses_the_run_id_and_a_failing_tracker_is_skipped(
        tmp_path: Path, empty_store: Path) -> None:
    """First launch: W&B and MLflow, whose run is deleted from the store while training (logging to it fails
    from then on): one warning, and the run and W&B go on. Second launch (a longer max_steps, W&B alone):
    the same W&B run id continues."""
    run_dir, client, env = tmp_path / "run", with_store(tmp_path, empty_store), subprocess_env(**SECRETS)

    def args(steps: int, loggers: str) -> list[str]:
        return on_the_cpu_plan(["+exp=toy", ONE, f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=10",
                                "data.sleep_s=0.01", "resume.allow_config_change=true", f"logger={loggers}",
                                f"launcher.setup=['export HF_TOKEN={SETUP_SECRET}']", f"hydra.run.dir={run_dir}"])

    proc = subprocess.Popen([sys.executable, "-m", "launcher", *args(40, "[mlflow,wandb]")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: logged_step(run_dir) >= 5)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    client.delete_run(run_id)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning: mlflow")]
    assert len(warnings) == 1 and "training goes on" in warnings[0], err[-3000:]
    assert max(m.step for m in client.get_metric_history(run_id, "loss")) < 40  # it really failed mid-run
    assert sorted(losses(run_dir)) == list(range(1, 41))  # metrics.jsonl has every step

    out = subprocess.run([sys.executable, "-m", "launcher", *args(45, "[wandb]")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = wandb_starts(run_dir)
    assert first["id"] == second["id"] == json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert first["group"] == ""  # one run id for both starts (above): W&B continued the same run
    assert {"exp:toy", "world_size:1", "precision:fp32"} <= set(first["tags"])
    assert [row["_step"] for row in first["history"] if "loss" in row] == list(range(1, 41))  # W&B went on
    assert [row["_step"] for row in second["history"] if "loss" in row] == list(range(41, 46))
    assert replay([first, second]) == pytest.approx(losses(run_dir), rel=1e-6)
    assert any("eval/loss" in row for row in first["history"])
    for start in (first, second):
        for secret in [*SECRETS.values(), SETUP_SECRET]:
            assert secret.encode() not in start["bytes"]


def test_a_tracker_that_cannot_start_stops_the_launch_in_one_line(tmp_path: Path) -> None:
    """A server that does not answer (credentials in its URI) and a URI MLflow does not know: exit 2,
    one line naming the key, no run dir; a relaunch into a run dir keeps the credentials out of it."""
    password = f"pw-{os.getpid()}-x"  # made here: the test's own source (in git.diff while edited) never holds it
    (tmp_path / "a-file").write_text("")
    for uri, fix in ((f"http://alice:{password}@127.0.0.1:9", "drop mlflow from logger=[...]"),
                     ("nope://tracking", "drop mlflow from logger=[...]"),
                     (f"sqlite:///{tmp_path}/a-file/mlflow.db", "point it at a writable path")):
        run_dir = tmp_path / "fresh"
        out = run_cli("+exp=toy", "logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}",
                      f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=120)
        assert out.returncode == 2, out.stderr[-3000:]
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith("error: logger.mlflow.tracking_uri") and fix in line, line
        assert password not in out.stdout + out.stderr and not run_dir.exists()
    existing = tmp_path / "existing"
    assert run_cli("+exp=toy", "launcher.dry_run=true", f"hydra.run.dir={existing}", cwd=tmp_path).returncode == 0
    out = run_cli("+exp=toy", "logger=[mlflow]", f"logger.mlflow.tracking_uri=http://alice:{password}@127.0.0.1:9",
                  f"hydra.run.dir={existing}", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and existing.is_dir()
    assert not [p for p in existing.rglob("*") if p.is_file() and password.encode() in p.read_bytes()]


class Broken(Tracker):
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, step: int, scalars: dict[str, float], kind: str) -> None:
        self.calls += 1
        raise ConnectionError("http://bob:pw-123@tracker.example/api unreachable")


def test_fan_out_turns_a_failing_tracker_off_after_one_warning_without_its_credentials() -> None:
    warnings: list[str] = []
    trackers, broken = Trackers(warnings.append), Broken()
    trackers.add("broken", lambda: broken)
    trackers.add("unopenable", lambda: 1 / 0)
    for step in range(3):
        trackers.call("log", step, {"loss": 1.0}, "train")
    assert broken.calls == 1 and len(warnings) == 2 and "pw-123" not in " ".join(warnings)


def test_params_are_flat_and_hold_no_secret() -> None:
    params = flat_params({"train": {"global_batch_size": 32, "profile": None}, "data": {"api_key": "k-1",
                          "tokenizer": "bert", "url": "https://u:p-2@host/x?token=t-3"}, "tags": ["a"]})
    assert params["train.global_batch_size"] == "32" and params["train.profile"] == "null"
    assert params["data.tokenizer"] == "bert" and params["tags"] == '["a"]'
    assert "k-1" not in str(params) and "p-2" not in str(params) and "t-3" not in str(params)
