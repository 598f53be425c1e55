"""A local -m sweep goes on past a point that fails as it trains, and its end names the failed points
(launcher/launch/sweep_points.py); a stop still ends it (tests/test_stop_signals.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import run_cli, subprocess_env


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
    assert lines[-1] == (f"error: 1 of 2 sweep points failed: #0 (data.noise=nan), run dir {sweep / '0'}; the others "
                         f"ran to their end (the sweep's command with hydra.sweep.dir={sweep} runs the failed points "
                         f"again and skips the finished)")
    status = subprocess.run([sys.executable, "-m", "launcher.launch.status", str(sweep)], capture_output=True,
                            text=True, env=subprocess_env())
    assert status.returncode == 0 and "FAILED" in status.stdout, status.stdout + status.stderr[-2000:]

    again = run_cli(*command, cwd=tmp_path)
    assert again.returncode == 1, again.stderr[-3000:]
    assert f"run dir {sweep / '1'} already finished: 8 steps" in again.stdout, again.stdout[-2000:]
    assert again.stderr.splitlines()[-1].startswith("error: 1 of 2 sweep points failed: #0 (data.noise=nan)")
