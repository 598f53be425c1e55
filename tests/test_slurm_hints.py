"""What launcher=slurm says beside a job's own result, against the real cluster of slurm/cluster.sh (the cluster
fixture, tests/conftest.py): a controller that does not answer is named as such, what sbatch refuses is one line,
so is a dependency Slurm would not wait for, and `python -m launcher.launch.status <sweep dir>` shows the values
each point ran with."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import on_the_cpu_plan, run_cli, subprocess_env
from helpers import store
from launcher.launch.slurm_jobs import slurm_state

pytestmark = pytest.mark.slow
TOY = ("+exp=toy", "train.max_steps=4", "train.log_every=1", "train.eval_every=0", "train.global_batch_size=16",
       "train.micro_batch_size=4")


def test_a_controller_that_does_not_answer_is_named_as_such(cluster, tmp_path: Path) -> None:
    """sbatch's "Unable to contact slurm controller" (slurmctld down: here, a slurm.conf whose controller port nothing
    serves) was reported as a refusal of launcher.nodes and launcher.timeout_min, keys that were fine."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("".join(line for line in Path("/etc/slurm/slurm.conf").read_text().splitlines(keepends=True)
                            if not line.startswith("SlurmctldPort")) + "SlurmctldPort=1\n")
    out = subprocess.run([sys.executable, "-m", "launcher", *on_the_cpu_plan([*TOY, "launcher=slurm",
                                                                              f"hydra.run.dir={tmp_path / 'run'}"])],
                         cwd=tmp_path, env=subprocess_env(SLURM_CONF=str(conf)), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "error: sbatch could not reach the Slurm controller (Batch job submission failed: Unable to contact slurm "
        "controller (connect failure)); nothing was submitted: check that slurmctld runs and answers (scontrol ping), "
        "then launch again"], out.stderr
    assert not (tmp_path / "run").exists()


def test_status_of_a_sweep_shows_the_overrides_its_points_do_not_share(cluster, tmp_path: Path) -> None:
    """Rows that differ only in their run dir's number said nothing of which point ran which values. Hydra
    spells a point's values its own way (optimizer.lr=1e-3 is optimizer.lr=0.001); what all points share (+exp=toy,
    launcher=slurm, train.seed=1) is left out. Two points: one wave of the array on this host's two nodes."""
    sweep = tmp_path / "sweep"
    out = run_cli("-m", *TOY, "launcher=slurm", "launcher.wait=true", "launcher.array_parallelism=2",
                  f"hydra.sweep.dir={sweep}", "optimizer.lr=1e-3,2e-3", "train.seed=1", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(sweep)], capture_output=True,
                            text=True, env=subprocess_env(), timeout=120)
    assert status.returncode == 0, status.stderr
    header, *rows = status.stdout.strip().splitlines()
    column = header.index("overrides")  # the last column: the table pads every column before it to one width
    shown = {(row.split()[0], row[column:]) for row in rows}
    assert sorted(shown) == [(str(sweep / "0"), "optimizer.lr=0.001"), (str(sweep / "1"), "optimizer.lr=0.002")], \
        status.stdout
    assert all(" COMPLETED " in row for row in rows), status.stdout


def test_what_sbatch_refuses_is_one_line_and_leaves_nothing(cluster, tmp_path: Path) -> None:
    """A partition the cluster has not: a traceback (exit 1) left the run dir and a RUNNING MLflow run behind."""
    out = run_cli(*TOY, "launcher=slurm", "launcher.partition=nope", "logger=[mlflow]",
                  f"hydra.run.dir={tmp_path / 'runs' / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: sbatch refused the job: invalid partition specified: nope; Batch job submission failed: Invalid "
        "partition name specified (launcher.partition=nope, launcher.nodes=1, launcher.timeout_min=60, "
        "launcher.nproc_per_node=2 (a CPU each)); check them against the cluster (sinfo, sacctmgr show assoc)"
    ], out.stderr
    assert not (tmp_path / "runs" / "run").exists()
    (run,) = store(tmp_path).search_runs([store(tmp_path).get_experiment_by_name("toy").experiment_id])
    assert run.info.status == "FAILED"



def test_a_dependency_slurm_would_not_wait_for_is_refused_in_one_line(cluster, tmp_path: Path) -> None:
    """sbatch took launcher.dependency=afterok:<a job no one knows> and ran the job at once; afterok on a job that
    failed is never met (Slurm cancels the job, or once it forgot that job, runs it at once)."""
    failed = subprocess.run(["sbatch", "--parsable", "--wrap", "exit 3", "-o", "/dev/null"], capture_output=True,
                            text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 120
    while slurm_state(failed) != "FAILED" and time.monotonic() < deadline:
        time.sleep(1)
    for dependency, why in ((f"afterok:{failed}", f"job {failed} ended FAILED, so afterok can never be met"),
                            ("afterany:99999999", "Slurm knows no job 99999999 (sacct, scontrol show job)")):
        out = run_cli(*TOY, "launcher=slurm", f"launcher.dependency={dependency}", f"hydra.run.dir={tmp_path / 'run'}",
                      cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            f"error: launcher.dependency={dependency}: {why}; name a job that squeue or sacct lists (or drop "
            f"launcher.dependency)"], out.stderr
        assert not (tmp_path / "run").exists()
    out = run_cli(*TOY, "launcher=slurm", "launcher.dry_run=true", f"launcher.dependency=afterany:{failed}",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)  # met once that job ended, however it ended
    assert out.returncode == 0 and f'"dependency": "afterany:{failed}"' in out.stdout, out.stderr[-2000:]
