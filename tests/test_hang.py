"""Hang reports (issue 13): a rank that stops mid-step is named, with its stack, from the run dir alone."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def test_a_rank_that_hangs_is_named_with_its_stack(tmp_path: Path) -> None:
    """Rank 1 sleeps in its 21st loss computation (the eval's probes and loss_sum's, 1 + 4 + 3, at the start, then step
    7's first of 2 micro-batches): within dist.hang_timeout_s both ranks write a report; rank 0's collective times out
    (dist.timeout_s) and the launcher's one-line error names rank 1 and where it was, while rank 0 waited."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    out = run_cli("+exp=toy", "train.global_batch_size=16", "train.micro_batch_size=4", "train.max_steps=20",
                  "launcher.nproc_per_node=2", "dist.hang_timeout_s=2", "dist.timeout_s=12", "launcher.shutdown_timeout_s=5",
                  "data.stall_rank=1", "data.stall_at_call=21", "data.stall_s=30", f"hydra.run.dir={run_dir}",
                  cwd=tmp_path)
    assert out.returncode != 0 and time.monotonic() - started < 120
    lines = out.stderr.strip().splitlines()
    error = [line for line in lines if line.startswith("error: ")]
    assert len(error) == 1, out.stderr[-3000:]
    assert "hung: rank 1 at step 7 (train) in jobs/toy.py" in error[0] and "loss_sum" in error[0], error[0]
    assert "while rank(s) [0] waited for it in a collective" in error[0] and str(run_dir / "hang") in error[0]
    reports = {int(p.stem.removeprefix("rank")): p.read_text() for p in (run_dir / "hang").glob("rank*.txt")}
    assert set(reports) == {0, 1}
    stalled, waiting = (json.loads(reports[r].splitlines()[0]) for r in (1, 0))
    assert (stalled["step"], stalled["phase"], stalled["waiting"]) == (7, "train", False)
    assert (waiting["step"], waiting["waiting"]) == (7, True) and waiting["where"].startswith("launcher/")
    assert 'File "' in reports[1] and "in loss_sum" in reports[1] and "in loss_sum" not in reports[0]


def test_a_rank_that_was_only_slow_leaves_no_report(tmp_path: Path) -> None:
    """A stall longer than dist.hang_timeout_s that ends: the reports written meanwhile are taken back."""
    run_dir = tmp_path / "run"
    out = run_cli("+exp=toy", "train.global_batch_size=16", "train.micro_batch_size=4", "train.max_steps=12",
                  "launcher.nproc_per_node=2", "dist.hang_timeout_s=2", "data.stall_rank=1", "data.stall_at_call=17",
                  "data.stall_s=8", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12
    assert not list((run_dir / "hang").glob("rank*"))


@pytest.mark.parametrize("startup_timeout_s,ok", [(60, True), (8, False)], ids=["covered", "control"])
def test_start_up_has_its_own_timeout(tmp_path: Path, startup_timeout_s: int, ok: bool) -> None:
    """dist.startup_timeout_s covers everything up to the end of the first step (compile, a rank that is
    slow to start): rank 1 is 20 s late in step 1 while dist.timeout_s=10. The hang test above shows that
    dist.timeout_s holds once the first step is done (its default start-up timeout is 30 minutes)."""
    run_dir = tmp_path / "run"
    out = run_cli("+exp=toy", "train.global_batch_size=16", "train.micro_batch_size=4", "train.max_steps=6",
                  "launcher.nproc_per_node=2", "dist.timeout_s=10", f"dist.startup_timeout_s={startup_timeout_s}",
                  "launcher.shutdown_timeout_s=5", "data.stall_rank=1", "data.stall_at_call=1", "data.stall_s=20",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert (out.returncode == 0) == ok, out.stderr[-3000:]
    if not ok:
        assert "Timed out" in out.stderr or "timeout" in out.stderr.lower()


@pytest.mark.parametrize("checkpoint_timeout_s,ok", [(60, True), (4, False)], ids=["covered", "control"])
def test_a_save_longer_than_the_collective_timeout_has_its_own(tmp_path: Path, checkpoint_timeout_s: int,
                                                               ok: bool) -> None:
    """Rank 0 takes 12 s to write the final checkpoint (a slow file system) while rank 1 waits for it and
    dist.timeout_s=4: dist.checkpoint_timeout_s covers the wait, and the run ends complete."""
    run_dir = tmp_path / "run"
    out = run_cli("+exp=toy", "train.global_batch_size=16", "train.micro_batch_size=8", "train.max_steps=3",
                  "launcher.nproc_per_node=2", "dist.timeout_s=4", f"dist.checkpoint_timeout_s={checkpoint_timeout_s}",
                  "launcher.shutdown_timeout_s=5", "data.save_sleep_s=12", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert (out.returncode == 0) == ok, out.stderr[-3000:]
    if ok:
        assert json.loads((run_dir / "summary.json").read_text())["checkpoint"].endswith("checkpoints/3")
    else:  # rank 1 gave up waiting
        assert "rank 1" in [line for line in out.stderr.splitlines() if line.startswith("error: ")][0], out.stderr
