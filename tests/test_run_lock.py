"""One launch at a time in a run dir: a second `python -m launcher` into a run dir whose launch goes on starts
nothing and writes nothing there (launcher=local and launcher=slurm alike); status shows the run RUNNING; the
lock goes with its process, however that ends, and so do its workers."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, on_the_cpu_plan, run_cli, subprocess_env
from helpers import COMMON, finish, logged_step, start, wait_until, worker_pid
from launcher.launch.run_lock import launch_lock, lock_holder
from launcher.preempt import REQUEUE_EXIT_CODE

HOLD = "import sys, time; from pathlib import Path; from launcher.launch.run_lock import launch_lock\n" \
       "with launch_lock(Path(sys.argv[1])) as holder:\n    assert holder is None; print('held', flush=True); " \
       "time.sleep(600)"


def status_row(run_dir: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(run_dir)], capture_output=True,
                         text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[1]


def test_the_lock_names_its_holder_and_goes_with_its_process(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with launch_lock(tmp_path) as other:
            assert other is not None and other.startswith(f"pid {holder.pid} on ")
        assert lock_holder(tmp_path) == other
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own runs
        holder.wait()
    assert lock_holder(tmp_path) is None
    with launch_lock(tmp_path) as other:
        assert other is None and lock_holder(tmp_path) is not None  # (this process holds it now)
        assert json.loads((tmp_path / "launch.lock").read_text())["pid"] == os.getpid()
    assert lock_holder(tmp_path) is None


def test_a_file_system_without_flock_runs_unlocked_with_a_note(tmp_path: Path, monkeypatch, capsys) -> None:
    """What Lustre mounted without -o flock answers (ENOSYS): the launch goes on, saying that it is not guarded."""
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    with launch_lock(tmp_path) as other:
        assert other is None
    assert lock_holder(tmp_path) is None
    assert "is on a file system without flock (Function not implemented)" in capsys.readouterr().err


def test_a_slurm_submission_into_a_run_dir_in_use_submits_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        # (were it not refused, its submission would fail: there is no Slurm cluster in this test)
        out = run_cli("+exp=toy", "launcher=slurm", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"error: run dir {run_dir}: a launch (pid {holder.pid} on " in out.stderr and "nothing started" in out.stderr
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "slurm.json").exists()


@pytest.mark.slow
def test_a_second_launch_into_a_running_run_dir_starts_nothing(tmp_path: Path) -> None:
    """The first launch trains on; the second, the same command in another terminal, would have resumed from the
    same checkpoint and trained beside it. It prints who runs there and leaves every file of the run as it was; so
    does the same command without hydra.run.dir, which goes on in its command's last run (it used to train a second
    copy of the run from step 0 in a new dir)."""
    overrides = on_the_cpu_plan([*COMMON, "data.sleep_s=0.05", "train.max_steps=100000"])
    first, runs = launch_in(tmp_path, overrides), tmp_path / "runs" / "toy"  # its run dir: runs/toy/<time>
    try:
        wait_until(lambda: runs.is_dir() and any(logged_step(run) >= 2 for run in runs.iterdir()))
        (run_dir,) = runs.iterdir()
        files = {name: (run_dir / name).read_text() for name in ("config.yaml", "launch.json")}
        for again in (launch_in(tmp_path, [*overrides, f"hydra.run.dir={run_dir}"]), launch_in(tmp_path, overrides)):
            try:  # (without the lock it trains beside the first: killed here, the test fails in 2 minutes)
                out, err = again.communicate(timeout=120)
            finally:
                again.kill()
            assert again.returncode == 1, out + err  # a script that launched it learns that nothing started
            assert f"error: run dir {run_dir}: a launch (pid {first.pid} on " in err and "nothing started" in err
            assert "worker(s)" not in out + err  # (the line of a launch that starts its workers)
            assert files == {name: (run_dir / name).read_text() for name in files}
        assert "(the last run of this same command: wait for it to end, or give hydra.run.dir=<a new dir>" in err
        assert list(runs.iterdir()) == [run_dir]
        assert " RUNNING " in status_row(run_dir)
    finally:
        first.send_signal(signal.SIGUSR2)  # preempted: it checkpoints and exits with the requeue code
    finish(first, REQUEUE_EXIT_CODE)
    assert lock_holder(run_dir) is None and " PREEMPTED " in status_row(run_dir)


def launch_in(cwd: Path, overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", *overrides], cwd=cwd, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_launcher_killed_outright_takes_its_workers_with_it(tmp_path: Path) -> None:
    """kill -9 of the launcher leaves no signal to relay. torchrun starts the workers in sessions of their own:
    they trained on, unwatched, with the run dir's lock gone, and a relaunch trained beside them."""
    run_dir = tmp_path / "run"
    first = start(run_dir, "data.sleep_s=0.05", "train.max_steps=100000")
    workers = []
    try:
        wait_until(lambda: logged_step(run_dir) >= 2)
        workers = [worker_pid(first.pid, rank) for rank in (0, 1)]
        first.kill()
        first.communicate(timeout=30)
        wait_until(lambda: not any(map(alive, workers)), timeout=10)
        step = logged_step(run_dir)
        time.sleep(1)
        assert logged_step(run_dir) == step  # nothing trains in the run dir any more
    finally:
        for pid in filter(alive, workers):  # (without the fix: stop them here)
            os.kill(pid, signal.SIGKILL)
