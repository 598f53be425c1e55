"""What several test modules use to start, stop and read back real runs: the toy trajectory of the resume
tests and its launches, the processes under a launcher, two "nodes" on this host, MLflow's embedded store and
the float64 runs and probe of the distributed math. Test modules import it, never each other, so that a file
collects without the others' optional packages (MLflow, W&B: imported only in the functions that use them)."""
from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, on_the_cpu_plan, read_metrics, run_cli, run_torchrun, subprocess_env, write_run_config
from launcher.preempt import REQUEUE_EXIT_CODE

if TYPE_CHECKING:
    from mlflow import MlflowClient

# The toy trajectory of tests/test_resume.py: reference runs and interrupted runs train the same one, and an
# interrupted run uses data.sleep_s so that a signal or a SIGKILL lands mid-training.
STEPS = 120
COMMON = ("+exp=toy", f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=0",
          "train.ckpt_every=20", "train.log_samples=true", "train.global_batch_size=16",
          "train.micro_batch_size=4")
SLOW = ("data.sleep_s=0.01",)  # about 25 ms per step on 2 ranks: time to signal mid-run
FP16 = ("precision=fp16", "precision.init_scale=1048576", "precision.growth_interval=5")
DROPOUT = ("model.dropout=0.3",)  # every forward draws from its rank's random stream


def start(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    args = on_the_cpu_plan([*COMMON, *overrides, f"hydra.run.dir={run_dir}"])
    return subprocess.Popen([sys.executable, "-m", "launcher", *args],
                            cwd=run_dir.parent, env=env or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, expect: int) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == expect, out[-2000:] + err[-4000:]
    return out + err


def wait_until(condition: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def logged_step(run_dir: Path) -> int:
    try:
        return max((m["step"] for m in read_metrics(run_dir)), default=0)
    except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or a line half-written
        return 0


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / str(step) / "model.safetensors")


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sample_stream(run_dir: Path) -> list[tuple[int, list[int]]]:
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return [(r["step"], r["sample_ids"]) for r in map(json.loads, lines)]


def children(parent: int) -> list[int]:
    """The pids of the processes whose parent is `parent` (a launcher's workers are its children)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def worker_pid(parent: int, rank: int) -> int:
    """The pid of the worker process with RANK=rank started by the launcher `parent`."""
    for pid in children(parent):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise LookupError(f"no rank {rank} worker under {parent}")


class References(dict):
    """Uninterrupted runs (fp32, fp16, with dropout, fsdp with dropout), each trained when a test first asks for it: a
    selection of the tests (CI's torch-floor run, tests/test_torch_floor.py) trains only what it compares.
    The `reference` fixture of tests/conftest.py hands out one per test module."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str) -> Path:
        run_dir = self.tmp_path_factory.mktemp("reference") / name
        finish(start(run_dir, *{"fp32": (), "fp16": FP16, "dropout": DROPOUT,
                                      "fsdp": ("strategy=fsdp", *DROPOUT)}[name]), 0)
        self[name] = run_dir
        return run_dir


def preempt(run_dir: Path, sig: signal.Signals, *extra: str, env: dict[str, str] | None = None) -> int:
    """Start a slow run, signal the launcher process (only it) mid-run; returns the preemption step."""
    proc = start(run_dir, *SLOW, *extra, env=env)
    wait_until(lambda: logged_step(run_dir) >= random.randint(25, 45))
    proc.send_signal(sig)
    out = finish(proc, REQUEUE_EXIT_CODE)
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert (run_dir / "checkpoints" / str(step) / "COMPLETE").exists()
    assert (f"by {sig.name}: checkpoint saved at step {step}; run the same command again (it continues in {run_dir}; or "
            f"add hydra.run.dir={run_dir}) to resume (exit code 75)") in out
    return step


# What node() trains (tests/test_many_nodes.py): float64, so that two nodes of one worker each compare with one
# node of two workers to rtol 1e-10
NODES_COMMON = ("+exp=toy", "model.dtype=float64", "data.dtype=float64", "train.max_steps=12", "train.eval_every=0",
                "train.global_batch_size=16", "train.micro_batch_size=4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(run_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    """One of two "nodes" on this host: a launcher with one CPU worker, meeting the other at 127.0.0.1:port."""
    args = on_the_cpu_plan([*NODES_COMMON, "launcher.nnodes=2", "launcher.nproc_per_node=1",
                            f"launcher.rdzv_endpoint=127.0.0.1:{port}", "launcher.rdzv_timeout_s=60", *overrides,
                            f"hydra.run.dir={run_dir}"])
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=run_dir.parent, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# The tracker tests' toy run (tests/test_tracking.py, tests/test_tracker_writes.py)
TOY = ("+exp=toy", "train.max_steps=20", "train.log_every=5", "train.eval_every=10")
ONE = "launcher.nproc_per_node=1"  # where the world size does not matter: fewer processes on a small machine


def store(cwd: Path) -> MlflowClient:
    from mlflow import MlflowClient  # an optional package: only the tests that read a store need it

    return MlflowClient(f"sqlite:///{cwd / 'runs' / 'mlflow.db'}")  # the embedded default, under the cwd


def with_store(cwd: Path, empty_store: Path) -> MlflowClient:
    """The store under `cwd`, its tables copied from the `empty_store` fixture's (tests/conftest.py)."""
    (cwd / "runs").mkdir()
    shutil.copy(empty_store, cwd / "runs" / "mlflow.db")
    return store(cwd)


# The distributed math (tests/test_distributed_math.py): float64 SGD runs and the probe's records of each rank
PROBE = REPO / "tests" / "probe_worker.py"
FLOAT64_SGD = ("+exp=toy", "data.dtype=float64", "optimizer=sgd", "train.log_every=1", "train.eval_every=0")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    (step_dir,) = (run_dir / "checkpoints").iterdir()
    return load_file(step_dir / "model.safetensors")


def train_cli(run_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    out = run_cli(*FLOAT64_SGD, f"hydra.run.dir={run_dir}", *overrides, cwd=run_dir.parent)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return final_weights(run_dir)


def trained(run_dir: Path, *overrides: str) -> Path:
    """A run of `python -m launcher <overrides>` into run_dir that must succeed."""
    out = run_cli(*overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return run_dir


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def profiled_ops(run_dir: Path) -> list[str]:
    """The names of the ops and ranges (complete events) in rank 0's train.profile trace."""
    trace = json.loads(next((run_dir / "profile").glob("rank0.*.pt.trace.json")).read_text())
    return [event["name"] for event in trace["traceEvents"] if event.get("ph") == "X"]


def assert_resumes_at_10_as_it_went_on(origin: Path, run_dir: Path, *overrides: str) -> None:
    """A copy of `origin` (a float64 run with checkpoints at steps 10 and 20) without step 20, trained on with
    `overrides` (another strategy or world size), reaches what `origin` reached at step 20."""
    shutil.copytree(origin, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "20")
    (run_dir / "summary.json").unlink()
    trained(run_dir, *overrides)
    assert summary(run_dir)["resumed_from"] == 10
    assert_params_close(weights(run_dir, 20), weights(origin, 20), rtol=1e-9)


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == torch.float64
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=0.0, msg=name)


def probe(run_dir: Path, nproc: int, mode: str, *overrides: str, inf_step: int = -1, exp: str = "toy") -> list[dict]:
    """Write the run config as the parent would, run the probe on `nproc` real ranks, read each rank's record."""
    config = write_run_config(run_dir, f"+exp={exp}", f"launcher.nproc_per_node={nproc}", *overrides)
    run_torchrun(nproc, PROBE, str(config), mode, str(inf_step))
    return [torch.load(run_dir / f"probe_rank{r}.pt", weights_only=True) for r in range(nproc)]
