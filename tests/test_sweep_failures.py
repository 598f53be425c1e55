"""A local -m sweep goes on past a point that fails as it trains, and its end names the failed points
(launcher/launch/sweep_points.py); a stop still ends it (tests/test_stop_signals.py)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import on_the_cpu_plan, run_cli, subprocess_env
from helpers import logged_step, wait_until


def test_a_failed_point_does_not_end_a_local_sweep_and_the_end_names_it(tmp_path: Path) -> None:
    """`-m ... data.noise=nan,0.05` ended at point 0 (its workers' exit, a SystemExit that Hydra's launcher does not
    catch): point 1 never ran, and nothing said so. Now point 1 trains to its end, the last line names point 0, and
    the exit is 1; the same command again runs point 0 again and skips point 1, which finished."""
    sweep = tmp_path / "sweep"
    command = ("-m", "+exp=toy", "launcher.nproc_per_node=1", "train.max_steps=8", "train.eval_every=0",
               "train.max_bad_steps=2", "data.noise=nan,0.05", f"hydra.sweep.dir={sweep}")
    out = run_cli(*command, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 8
    assert not (sweep / "0" / "summary.json").exists()
    lines = out.stderr.splitlines()
    assert lines[-2].startswith("error: rank 0 failed: RuntimeError: 2 consecutive steps had non-finite gradients"), lines
    assert lines[-1] == (f"error: 1 of 2 sweep points failed: #0 (data.noise=nan), run dir {sweep / '0'}; the sweep's "
                         f"command with hydra.sweep.dir={sweep} runs them again and skips the finished")
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(sweep)], capture_output=True,
                            text=True, env=subprocess_env())
    assert status.returncode == 0 and "FAILED" in status.stdout, status.stdout + status.stderr[-2000:]

    again = run_cli(*command, cwd=tmp_path)
    assert again.returncode == 1, again.stderr[-3000:]
    assert f"run dir {sweep / '1'} already finished: 8 steps" in again.stdout, again.stdout[-2000:]
    assert again.stderr.splitlines()[-1].startswith("error: 1 of 2 sweep points failed: #0 (data.noise=nan)")


def test_a_closed_terminal_ends_a_local_sweep_in_one_line(tmp_path: Path) -> None:
    """SIGHUP (a closed terminal or ssh session) is no preemption signal: torchrun's agent ends the workers with no
    checkpoint and the launch exits 129. That is a stop, not a failed point: the sweep ends there, with a line (it
    said nothing), and the failed point before it is still named."""
    sweep = tmp_path / "sweep"
    command = ["-m", "+exp=toy", "launcher.nproc_per_node=1", "train.max_steps=400", "train.eval_every=0",
               "train.max_bad_steps=2", "data.sleep_s=0.05", "data.noise=nan,0.05,0.1", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *on_the_cpu_plan(command)], cwd=tmp_path,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: logged_step(sweep / "1") >= 2)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    assert not (sweep / "2").exists()
    assert err.splitlines()[-2:] == [
        "stopped by SIGHUP, which saves no checkpoint (launcher.signal and SIGTERM/SIGINT do); a relaunch resumes from "
        "the latest one (exit code 129)",
        f"error: 1 of 3 sweep points failed: #0 (data.noise=nan), run dir {sweep / '0'}; the sweep's command with "
        f"hydra.sweep.dir={sweep} runs them again and skips the finished"], err[-3000:]
