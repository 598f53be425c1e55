"""What a run dir keeps of a start: launcher.log with what was printed, error.txt for a failure, and `status`
telling a failed, a finished and a dry run apart (launcher/launch/run_log.py, launcher/launch/status.py)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, on_the_cpu_plan, run_cli, subprocess_env

pytestmark = pytest.mark.slow
TOY = ("+exp=toy", "train.log_every=10", "train.eval_every=0", "train.global_batch_size=16", "train.micro_batch_size=8")


def status(*dirs: Path, cwd: Path = REPO) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "launcher.launch.status", *map(str, dirs)], cwd=cwd,
                         env=subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_failed_start_leaves_its_error_and_the_next_start_its_own_record(tmp_path: Path) -> None:
    """A failure only the workers find (a train set smaller than one step) is on record in the run dir: its line in
    error.txt with the rank's traceback, in launcher.log, and status says FAILED with that line. The fixed command
    in the same run dir clears it; launcher.log keeps both starts, and the done line counts a start's own steps."""
    run_dir = tmp_path / "run"
    failed = run_cli(*TOY, "data.n_samples=8", "train.drop_last=true", "train.max_steps=20",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert failed.returncode == 1
    line = next(line for line in failed.stderr.splitlines() if line.startswith("error: rank "))
    assert "the train set has 8 samples, fewer than train.global_batch_size=16" in line
    error = (run_dir / "error.txt").read_text()
    assert error.splitlines()[0] == line and "Traceback (most recent call last)" in error
    assert "raise ConfigError(f\"the train set has" in error  # where, in the worker's code
    assert "Traceback" not in failed.stderr  # a config mistake: each rank's would say nothing more than the line
    log = (run_dir / "launcher.log").read_text()
    assert f"run dir {run_dir} | 2 worker(s) on cpu" in log and line in log and "\x1b[" not in log
    rows = status(run_dir)
    assert rows[1].split()[2] == "FAILED" and rows[2] == f"{run_dir}: {line} (more in {run_dir / 'error.txt'})"

    fixed = run_cli(*TOY, "train.max_steps=20", "train.ckpt_every=10", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert not (run_dir / "error.txt").exists() and "\x1b[" not in fixed.stdout + fixed.stderr  # no colour codes off a tty
    # start-up, phase by phase, with the time since the launch; off a terminal the step lines carry an ETA
    phases = [line for line in fixed.stdout.splitlines() if re.search(r" \(\d+\.\ds after the launch\)$", line)]
    assert [line.split(" (")[0] for line in phases] == [
        "rendezvous done: world size 2; building the job", "first step"], phases
    assert re.search(r"^step 10/20 \| .* \| eta \d+s$", fixed.stdout, re.M), fixed.stdout
    assert status(run_dir)[1].split()[2] == "DONE"
    more = run_cli(*TOY, "train.max_steps=30", "train.ckpt_every=10", "resume.allow_config_change=true",
                   f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    done = [line for line in more.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: 10 steps (steps 21-30) in "), done
    log = (run_dir / "launcher.log").read_text()
    assert line in log and "done: 20 steps in " in log and done[0] in log  # every start, rank 0's lines too
    assert "step 30/30 | " in log and "resumed from step 20" in log


def test_a_dry_run_is_told_apart_and_torchrun_s_thread_banner_is_the_launcher_s_line(tmp_path: Path) -> None:
    """Also: bf16 on a CPU without bf16 instructions (CI's: AVX2 only) is slower than fp32, which one line says."""
    run_dir = tmp_path / "dry"
    out = run_cli(*TOY, "precision=bf16", "launcher.dry_run=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    if flags and not {"avx512_bf16", "amx_bf16"} & flags:  # emulated here
        assert re.search(r"warning: precision=bf16 on this CPU is emulated .* a matmul took \d+\.\dx its fp32 time",
                         out.stderr), out.stderr
    assert status(run_dir)[1].split()[2] == "DRY-RUN"
    assert "dry run: would run python -m torch.distributed.run" in (run_dir / "launcher.log").read_text()
    assert run_cli(*TOY, "launcher.dry_run=true", cwd=tmp_path).returncode == 0  # into ./runs/toy/<time>
    rows = status(cwd=tmp_path)  # no dir named: the launcher's default dirs under the cwd
    assert len(rows) == 2 and rows[1].startswith("runs/toy/") and rows[1].split()[2] == "DRY-RUN", rows
    rows = status(run_dir, tmp_path / "runs")
    assert len(rows) == 3 and rows[1].split()[0] == str(run_dir), rows
    assert rows[2].split()[0].startswith(f"{tmp_path / 'runs' / 'toy'}/"), rows
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS", None)
    ran = subprocess.run([sys.executable, "-m", "launcher", *on_the_cpu_plan([*TOY, "train.max_steps=2",
                                                                              f"hydra.run.dir={tmp_path / 'ran'}"])],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "OMP_NUM_THREADS" not in ran.stderr and re.search(r"2 worker\(s\) on cpu, \d+ thread\(s\) each", ran.stdout)


def test_status_starts_without_torch_and_names_a_missing_dir(tmp_path: Path) -> None:
    """status imported torch through the Slurm task's module (3.6 s a call here, 2.8 of them torch's import): the
    job states it reads come from a module of their own. A dir that is not there was only a usage line."""
    check = "import sys, launcher.launch.status; assert 'torch' not in sys.modules, 'status imports torch'"
    assert subprocess.run([sys.executable, "-c", check], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True).returncode == 0
    out = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(tmp_path / "nope")], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == (f"error: {tmp_path / 'nope'} is not a directory; name a run "
                                                          f"dir or a sweep dir (the launcher prints it)")
    out = subprocess.run([sys.executable, "-m", "launcher.launch.status"], cwd=tmp_path, env=subprocess_env(),
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: no run dir (a config.yaml with a launch.json) under "
                                                         "./runs or ./multirun (the launcher's default dirs); usage: ")


def test_a_run_whose_output_nobody_reads_any_more_trains_to_its_end(tmp_path: Path) -> None:
    """`python -m launcher ... | head -1`: rank 0's next line raised BrokenPipeError and failed the run. The launcher
    and its workers now write on into the run dir only, and the run ends as it would have."""
    run_dir = tmp_path / "run"
    launch = subprocess.Popen([sys.executable, "-m", "launcher", *on_the_cpu_plan(
        [*TOY, "train.max_steps=40", "train.log_every=1", f"hydra.run.dir={run_dir}"])], cwd=tmp_path,
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert launch.stdout.readline().startswith(f"run dir {run_dir} | 2 worker(s)")
    launch.stdout.close()  # as head does, before the workers start
    assert launch.wait(timeout=300) == 0
    assert (run_dir / "summary.json").is_file() and not (run_dir / "error.txt").exists()
    assert "step 40/40 | " in (run_dir / "launcher.log").read_text()
