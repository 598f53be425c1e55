"""launcher=slurm against a real Slurm cluster (munged + MariaDB/slurmdbd + slurmctld + 2 slurmd) that
slurm/cluster.sh starts on this host (issue 5). Skipped, with the reason, only when it cannot start
here (not root, no apt); CI sets LAUNCHER_REQUIRE_SLURM=1 so that it never skips there."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_same_float64_weights, read_metrics, run_cli, subprocess_env
from launcher.launch.run_lock import launch_lock, lock_holder
from launcher.launch.slurm_jobs import ACTIVE, slurm_state

pytestmark = pytest.mark.slow
TOY = ("+exp=toy", "train.max_steps=40", "train.log_every=1", "train.eval_every=0", "train.global_batch_size=16",
       "train.micro_batch_size=4")
SUBMITTED = re.compile(r"submitted job (\S+): run dir (\S+)")


def submitted(stdout: str) -> dict[str, Path]:
    return {job: Path(run_dir) for job, run_dir in SUBMITTED.findall(stdout)}


def final_state(job_id: str, timeout_s: float = 90) -> str:
    """The job's state once Slurm has ended it. submitit returns as soon as the task wrote its result,
    while the task process, the epilog and accounting may still be running, so sacct can say RUNNING
    for a few more seconds; a job that never ends still fails, on the deadline."""
    deadline = time.time() + timeout_s
    while (state := slurm_state(job_id)) in ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "COMPLETING", "UNKNOWN"):
        if time.time() > deadline:
            return state
        time.sleep(1)
    return state


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    (step_dir,) = [p for p in (run_dir / "checkpoints").iterdir() if p.name == "40"]
    return load_file(step_dir / "model.safetensors")


def local_reference(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "local"
    out = run_cli(*TOY, *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def local_toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy's 2-rank run launched locally, which the jobs of the same config must equal bitwise."""
    return local_reference(tmp_path_factory.mktemp("local-toy"))


def test_one_node_two_workers_completes(cluster, tmp_path: Path, local_toy: Path) -> None:
    """Issue 5 test 1: launcher=slurm, 1 node x 2 CPU workers: completes, run dir complete, exit 0."""
    out = run_cli(*TOY, "launcher=slurm", "launcher.wait=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ((job, run_dir),) = submitted(out.stdout).items()
    assert final_state(job) == "COMPLETED"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "40" / "COMPLETE").is_file()
    assert len([m for m in read_metrics(run_dir) if "loss" in m]) == 40
    slurm_job = json.loads((run_dir / "launch.json").read_text())["slurm_job"]  # the node's view, for bug reports
    assert slurm_job["SLURM_JOB_ID"] == job and slurm_job["SLURM_JOB_NODELIST"]
    # the node's task (its agent and both workers) runs on the CPUs the job asked for (launcher.cpus_per_task, null:
    # one per worker), not on the one core a Slurm 22.05-23.02 step gets by default where tasks are bound to cores
    assert slurm_job["usable_cpus"] >= 2, slurm_job
    # the rendezvous is at the first node's address: the host's own where it has one not loopback (slurm/cluster.sh)
    node_addr = re.search(r"NodeAddr=(\S+)", Path("/etc/slurm/slurm.conf").read_text()).group(1)
    assert slurm_job["SLURM_LAUNCH_NODE_IPADDR"] == node_addr, slurm_job
    assert bitwise(weights(run_dir), weights(local_toy))  # the same trajectory as locally


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_nodes_make_world_four_like_a_local_world_four(cluster, tmp_path: Path) -> None:
    """Issue 5 test 2: 2 emulated nodes x 2 workers; every rank checks WORLD_SIZE against the plan (4)."""
    out = run_cli(*TOY, "launcher=slurm", "launcher.nodes=2", "launcher.wait=true",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ((job, run_dir),) = submitted(out.stdout).items()
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 4
    reference = local_reference(tmp_path, "launcher.nproc_per_node=4")
    assert json.loads((reference / "summary.json").read_text())["world_size"] == 4
    slurm_losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    local_losses = [m["loss"] for m in read_metrics(reference) if "loss" in m]
    assert len(slurm_losses) == 40 and slurm_losses == pytest.approx(local_losses, rel=1e-5)
    for name, tensor in weights(reference).items():
        torch.testing.assert_close(weights(run_dir)[name], tensor, rtol=1e-5, atol=1e-7)


def test_sweep_is_one_job_array_and_a_raising_point_fails(cluster, tmp_path: Path) -> None:
    """Issue 5 test 3: -m with 4 points and parallelism 2 -> one array of 4; status lists them;
    a point that raises ends FAILED and launcher.wait=true exits non-zero."""
    sweep = tmp_path / "sweep"
    out = run_cli("-m", *TOY, "launcher=slurm", "launcher.array_parallelism=2", f"hydra.sweep.dir={sweep}",
                  "optimizer.lr=1e-3,2e-3", "train.seed=0,1", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]  # returns at once, with the ids
    jobs = submitted(out.stdout)
    assert len(jobs) == 4 and len(set(jobs.values())) == 4
    assert len({job.split("_")[0] for job in jobs}) == 1  # one array
    assert "] Checking 4 sweep points, then submitting them as one Slurm job array\n" in out.stdout, out.stdout[-2000:]
    # status while the array runs: each point's own state, from one sacct call (+ one squeue call for the
    # tasks still pending, which sacct has no row for) for the whole sweep, through shims that count them
    shims, calls = tmp_path / "bin", tmp_path / "slurm-calls"
    shims.mkdir()
    for command in ("sacct", "squeue"):
        (shims / command).write_text(f'#!/bin/sh\necho {command} >> {calls}\nexec {shutil.which(command)} "$@"\n')
        (shims / command).chmod(0o755)
    env = subprocess_env()
    env["PATH"] = f"{shims}:{env['PATH']}"
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(sweep)], capture_output=True,
                            text=True, env=env)
    states = {row.split()[1]: row.split()[2] for row in status.stdout.strip().splitlines()[1:]}
    assert states.keys() == jobs.keys() and set(states.values()) <= ACTIVE | {"COMPLETED"}, status.stdout
    # squeue for what sacct has no row for: the tasks still pending (a task may start between the two calls)
    assert calls.read_text().split() in (["sacct"], ["sacct", "squeue"]), calls.read_text()
    assert "PENDING" not in states.values() or "squeue" in calls.read_text(), (calls.read_text(), states)
    assert {job: final_state(job, timeout_s=240) for job in jobs} == dict.fromkeys(jobs, "COMPLETED")
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(sweep)], capture_output=True,
                            text=True, env=subprocess_env())
    rows = status.stdout.strip().splitlines()[1:]
    assert len(rows) == 4 and all(" COMPLETED " in row and " 40 " in row for row in rows), status.stdout
    # The sweep's command again: every point finished, so nothing is submitted
    again = run_cli("-m", *TOY, "launcher=slurm", "launcher.array_parallelism=2", f"hydra.sweep.dir={sweep}",
                    "optimizer.lr=1e-3,2e-3", "train.seed=0,1", cwd=tmp_path)
    assert again.returncode == 0 and "submitted job" not in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert sorted(re.findall(r"run dir (\S+) already finished: 40 steps", again.stdout)) == sorted(map(str, jobs.values()))

    failing = tmp_path / "failing"
    out = run_cli("-m", *TOY, "launcher=slurm", "launcher.wait=true", "train.max_bad_steps=2",
                  f"hydra.sweep.dir={failing}", "data.noise=0.05,nan", cwd=tmp_path)
    assert out.returncode == 1
    states = {run_dir.name: final_state(job) for job, run_dir in submitted(out.stdout).items()}
    assert states == {"0": "COMPLETED", "1": "FAILED"}
    # the wait says the state Slurm ended the job in (sacct says RUNNING a little longer) and why; launcher.log too
    (said,) = [line for line in out.stderr.splitlines() if line.startswith("error: job")]
    why = r"rank \d failed: RuntimeError: 2 consecutive steps had non-finite gradients \(train.max_bad_steps=2\)"
    assert re.fullmatch(rf"error: job \S+ ended FAILED: {why}.*; run dir {failing / '1'}, log \S+; relaunch .*", said)
    assert re.search(rf"^error: {why}", (failing / "1" / "launcher.log").read_text(), re.MULTILINE)


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if max(m["step"] for m in read_metrics(run_dir)) >= step:
                return
        except (FileNotFoundError, ValueError):  # not started yet, or a line half-written
            pass
        assert time.time() < deadline, "the job did not get there in time"
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["signal", "requeue"])
def test_preempted_or_requeued_job_resumes_in_the_same_run_dir(cluster, tmp_path: Path, local_toy: Path,
                                                              how: str) -> None:
    """Issue 5 test 4: `scancel --signal=USR2` -> checkpoint -> requeue -> resume in the same run dir,
    bitwise equal to an uninterrupted run. `scontrol requeue` (a node failure: no signal, no
    checkpoint then) resumes from the latest complete checkpoint."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *TOY, "launcher=slurm", "launcher.wait=true",
                             "data.sleep_s=0.02", "train.ckpt_every=10", "train.log_samples=true",
                             f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 15)
    job = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    assert re.fullmatch(r"pid \d+ on \S+ since \S+", lock_holder(run_dir) or "")  # the job holds its run dir
    if how == "signal":
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
    else:
        subprocess.run(["scontrol", "requeue", job], check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    log = "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("*_log.*")))
    if how == "signal":
        assert json.loads((run_dir / "requeues.json").read_text()) == {"job_id": job, "count": 1}
        assert len(re.findall(r"preempted by SIGUSR2: checkpoint saved at step", log)) == 1, log[-3000:]
    assert re.search(r"resumed from step (\d+)", log)
    assert final_state(job) == "COMPLETED"
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == list(range(1, 41))
    assert bitwise(weights(run_dir), weights(local_toy))


def test_out_of_memory_past_a_redo_requeues_the_job_at_half_the_micro_batch(cluster, tmp_path: Path) -> None:
    """train.micro_batch_size=auto on 2 nodes x 2 workers: rank 3 runs out of memory in the backward that holds
    step 9's all-reduce (no accumulation), so its workers exit with 76, and the other node's fail in the
    all-reduce. The node that ran out requeues the job, with no resubmission; it resumes from step 8 at
    micro-batch 2 and ends with the weights of a local world of 4 that never ran out (float64)."""
    shape = ("+exp=toy", "model.dtype=float64", "data.dtype=float64", "train.max_steps=12", "train.log_every=1",
             "train.eval_every=0", "train.ckpt_every=4", "train.global_batch_size=16")  # 4 per rank
    reference = tmp_path / "local"
    out = run_cli(*shape, "launcher.nproc_per_node=4", "train.micro_batch_size=4", f"hydra.run.dir={reference}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "run"
    out = run_cli(*shape, "launcher=slurm", "launcher.nodes=2", "launcher.wait=true", "train.micro_batch_size=auto",
                  "data.oom_rank=3", "data.oom_max_items=2", "data.oom_from_call=10", "data.oom_in_backward=true",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ((job, _),) = submitted(out.stdout).items()
    assert final_state(job) == "COMPLETED"
    log = "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("*_log.*")))
    assert "rank 3 ran out of memory in or after the gradient all-reduce of step 9" in log, log[-3000:]
    assert "(a launcher=slurm job requeues itself)" in log
    requeued = f"requeued: ran out of memory; job {job} resumes in {run_dir} (requeue 1 of launcher.max_requeues=3)"
    assert log.count(requeued) == 1 and "resumed from step 8" in log
    assert json.loads((run_dir / "requeues.json").read_text()) == {"job_id": job, "count": 1}
    sizes = {m["step"]: m["micro_batch_size"] for m in read_metrics(run_dir) if "loss" in m}
    assert sizes == {step: 4 if step <= 8 else 2 for step in range(1, 13)}
    assert_same_float64_weights(run_dir, reference, 12)


def test_dry_run_prints_the_plan_and_submits_nothing(cluster, tmp_path: Path) -> None:
    """Issue 5 test 5."""
    before = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True, text=True).stdout
    out = run_cli(*TOY, "launcher=slurm", "launcher.nodes=2", "launcher.dry_run=true", "launcher.partition=debug",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run: would submit one job" in out.stdout and '"nodes": 2' in out.stdout
    assert '"partition": "debug"' in out.stdout and "--nnodes=2 --nproc-per-node=2" in out.stdout
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip() == ""
    assert subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True, text=True).stdout == before


def sacct_times(job_id: str) -> tuple[str, str]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "Start,End"], capture_output=True,
                         text=True).stdout
    start, end = out.strip().splitlines()[0].split("|")
    return start, end  # ISO 8601: compared as strings


def test_launcher_after_starts_a_job_once_the_named_run_completed(cluster, tmp_path: Path) -> None:
    """Issue 15 (Slurm part): job B with launcher.after=<run dir of A> stays pending with reason Dependency
    while A runs, and starts only once A has completed (sacct's times)."""
    out = run_cli(*TOY, "launcher=slurm", "data.sleep_s=0.4", cwd=tmp_path)  # in runs/toy/<time>/, 30 s of steps
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ((job_a, run_a),) = submitted(out.stdout).items()
    out = run_cli(*TOY, "launcher=slurm", f"launcher.after={run_a}", f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ((job_b, _),) = submitted(out.stdout).items()
    reason = subprocess.run(["squeue", "-h", "-j", job_b, "-o", "%T %r"], capture_output=True, text=True).stdout
    assert reason.split() == ["PENDING", "Dependency"], (reason, slurm_state(job_a))
    # B's command again while B waits: a second job in B's run dir would train beside it, so none is submitted
    b_again = (*TOY, "launcher=slurm", f"launcher.after={run_a}", f"hydra.run.dir={tmp_path / 'b'}")
    again = run_cli(*b_again, cwd=tmp_path)
    assert again.returncode == 0 and "submitted job" not in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"run dir {tmp_path / 'b'}: its job {job_b} is PENDING; nothing to start" in again.stdout
    # A's command again while A trains: it continues A's run dir (A's job holds its lock), and says so as B's does
    wait_for_step(run_a, 1)
    again = run_cli(*TOY, "launcher=slurm", "data.sleep_s=0.4", cwd=tmp_path)
    assert again.returncode == 0 and f"run dir {run_a}: its job {job_a} is RUNNING; nothing to start" in again.stdout
    assert final_state(job_a, timeout_s=300) == "COMPLETED"
    assert final_state(job_b, timeout_s=300) == "COMPLETED"
    assert sacct_times(job_b)[0] >= sacct_times(job_a)[1]  # B started once A had ended
    assert f"run dir {tmp_path / 'b'} already finished: 40 steps" in run_cli(*b_again, cwd=tmp_path).stdout


def test_a_job_whose_run_dir_is_in_use_when_it_starts_trains_nothing(cluster, tmp_path: Path) -> None:
    """The job takes its run dir's lock on its first node, as a local launch does: one that finds it taken (here
    by this test, standing in for a launch that started while the job waited, its squeue unanswered) fails with
    who holds it, and writes no step; its second node leaves the rendezvous after launcher.rdzv_timeout_s."""
    blocker = subprocess.run(["sbatch", "--parsable", "--wrap", "sleep 3", "-o", "/dev/null"], capture_output=True,
                             text=True, check=True).stdout.strip()
    run_dir = tmp_path / "run"
    out = run_cli(*TOY, "launcher=slurm", "launcher.nodes=2", "launcher.rdzv_timeout_s=10",
                  f"launcher.dependency=afterok:{blocker}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ((job, _),) = submitted(out.stdout).items()
    with launch_lock(run_dir) as holder:
        assert holder is None
        assert final_state(job, timeout_s=120) == "FAILED"
    log = "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("*_log.*")))
    assert "(launcher.rdzv_timeout_s=10); another node of the job failed before its agent started" in log, log[-3000:]
    assert re.search(rf"run dir {run_dir}: a launch \(pid {os.getpid()} on \S+ since \S+\) runs there; job {job} "
                     rf"starts nothing", log), log[-3000:]
    assert not (run_dir / "metrics.jsonl").exists() and lock_holder(run_dir) is None
    # A run to follow it: afterok holds while Slurm remembers the failed job (MinJobAge), then let the next start
    after = run_cli(*TOY, "launcher=slurm", f"launcher.after={run_dir}", f"hydra.run.dir={tmp_path / 'next'}",
                    cwd=tmp_path)
    assert after.returncode == 2 and after.stderr.strip().splitlines() == [
        f"error: launcher.after={run_dir}: its job {job} ended FAILED before the run finished; resubmit it "
        f"(hydra.run.dir={run_dir}), then this run with launcher.after again"], after.stderr
    assert not (tmp_path / "next").exists()
