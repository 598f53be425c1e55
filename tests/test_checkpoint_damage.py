"""Resumes over damaged checkpoints, and over a config change that resume.allow_config_change lets through.

A save killed mid-write leaves checkpoints/.tmp-<step>; a truncated or corrupt checkpoint fails its checksums.
Neither may cost the checkpoints that the resumed run writes, and a run none of whose checkpoints reads back
does not start over on its own; a save that rank 0 cannot write stops every rank with its error. Exercised
with real launches of the toy job on 2 ranks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run_cli, run_torchrun
from launcher.rundir import complete_steps
from launcher.train.schedule import lr_factor

pytestmark = pytest.mark.slow
TOY = ("+exp=toy", "train.log_every=1", "train.eval_every=0", "train.global_batch_size=16",
       "train.micro_batch_size=4", "launcher.nproc_per_node=2")


def launch(run_dir: Path, *overrides: str):
    return run_cli(*TOY, *overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent)


def truncate(run_dir: Path, step: int) -> None:
    weights = run_dir / "checkpoints" / str(step) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def test_unusable_newer_checkpoints_are_moved_aside_and_cost_no_new_one(tmp_path: Path) -> None:
    """Steps 20 and 30 truncated, a killed save's temp dir, a retention's rest: the resume from 10 moves 20 and
    30 aside and deletes the others. Left in place, 20 and 30 would count as the newest two, and the retention of the
    save at 16 (train.ckpt_every=8) would delete 10 and 16 itself."""
    run_dir = tmp_path / "run"
    first = launch(run_dir, "train.max_steps=30", "train.ckpt_every=10", "train.keep_checkpoints=3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert complete_steps(run_dir) == [10, 20, 30]
    truncate(run_dir, 20)
    truncate(run_dir, 30)
    (run_dir / "checkpoints" / ".tmp-25").mkdir()
    (run_dir / "checkpoints" / ".tmp-25" / "model.safetensors").write_bytes(b"half")
    (run_dir / "checkpoints" / "5").mkdir()  # what a retention could not delete: its marker goes first
    (run_dir / "checkpoints" / "5" / "model.safetensors").write_bytes(b"old")
    second = launch(run_dir, "train.max_steps=40", "train.ckpt_every=8", "resume.allow_config_change=true")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 10" in second.stdout
    assert complete_steps(run_dir) == [32, 40]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [".unusable-20", ".unusable-30", "32", "40"]
    assert "moved the unusable checkpoints aside" in second.stdout + second.stderr


def test_a_run_none_of_whose_checkpoints_reads_back_stops_then_starts_over_when_launched_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert launch(run_dir, "train.max_steps=20", "train.ckpt_every=10").returncode == 0
    truncate(run_dir, 10)
    truncate(run_dir, 20)
    failed = launch(run_dir, "train.max_steps=30", "resume.allow_config_change=true")
    assert failed.returncode == 1
    assert "no checkpoint of this run reads back whole" in failed.stderr.strip().splitlines()[-1]
    assert "Traceback" not in failed.stderr  # rank 0 found it; every rank says it as the one line it is (ConfigError)
    assert complete_steps(run_dir) == [] and (run_dir / "checkpoints" / ".unusable-10").is_dir()
    again = launch(run_dir, "train.max_steps=30", "resume.allow_config_change=true")
    assert again.returncode == 0 and "resumed from" not in again.stdout, again.stderr[-3000:]
    assert complete_steps(run_dir) == [30]


def test_a_resume_under_a_changed_lr_and_schedule_follows_the_new_config(tmp_path: Path) -> None:
    """The checkpoint holds the optimizer's state and the schedule's position; optimizer.lr, its betas and
    the schedule's shape come from the config (loaded whole, the old lr would stay, silently)."""
    run_dir = tmp_path / "run"
    assert launch(run_dir, "train.max_steps=20", "scheduler=cosine", "scheduler.warmup_steps=5").returncode == 0
    before = {m["step"]: m["lr"] for m in read_metrics(run_dir) if "lr" in m}
    resumed = launch(run_dir, "train.max_steps=40", "scheduler=linear", "scheduler.warmup_steps=5",
                     "optimizer.lr=0.5", "optimizer.betas=[0.5,0.6]", "resume.allow_config_change=true")
    assert resumed.returncode == 0 and "resumed from step 20" in resumed.stdout, resumed.stderr[-3000:]
    after = {m["step"]: m["lr"] for m in read_metrics(run_dir) if "lr" in m and m["step"] > 20}
    # the lr logged at step s is the schedule's after s real steps, as in the first run
    assert before == pytest.approx({s: 1e-3 * lr_factor(s, "cosine", 5, 20, 0.0) for s in before}, rel=1e-6)
    assert after == pytest.approx({s: 0.5 * lr_factor(s, "linear", 5, 40, 0.0) for s in range(21, 41)}, rel=1e-6)
    saved = torch.load(run_dir / "checkpoints" / "40" / "train_state.pt", weights_only=True)["optimizer"]
    assert [tuple(g["betas"]) for g in saved["param_groups"]] == [(0.5, 0.6)] * len(saved["param_groups"])


SAVE_INTO_A_FILE = """import json, os, sys
from pathlib import Path
import torch
from launcher.train import checkpoint, dist
env = dist.init("cpu", "gloo", 60)
run_dir = Path(sys.argv[1])
try:
    checkpoint.save(run_dir, 5, torch.nn.Linear(2, 2), {}, 2, env.device)
    outcome = "saved"
except Exception as error:
    outcome = f"{type(error).__name__}: {error}"
(run_dir / f"rank{env.rank}.json").write_text(json.dumps(outcome))
dist.shutdown()
"""


def test_a_save_rank_0_cannot_write_fails_on_every_rank_with_its_error(tmp_path: Path) -> None:
    """checkpoints/ is a file here: rank 0's write fails. The other ranks, on other nodes in a real job, waited
    in the barrier after the save (until dist.timeout_s, or a peer's dropped connection); they now get its error."""
    (tmp_path / "checkpoints").write_text("not a dir")
    script = tmp_path / "save.py"
    script.write_text(SAVE_INTO_A_FILE)
    run_torchrun(2, script, str(tmp_path), timeout=120)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"RuntimeError: checkpoint of step 5 in {tmp_path / 'checkpoints'} failed: "), outcomes
