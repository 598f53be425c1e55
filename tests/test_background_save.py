"""train.ckpt_async (the default): checkpoints copied at their step and written while training goes on, never torn
(launcher/train/background_save.py)."""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_model

from conftest import on_the_cpu_plan, read_metrics, run_cli, subprocess_env
from helpers import DROPOUT, SLOW, bitwise_equal, finish, wait_until, weights, worker_pid
from launcher.rundir import MARKER, complete_steps
from launcher.train import checkpoint
from launcher.train.background_save import BackgroundSave, HostWeights


class Tied(torch.nn.Module):
    """An embedding and a decoder that share one weight, as BERT's do."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.decode = torch.nn.Linear(4, 10, bias=False)
        self.decode.weight = self.embed.weight


def test_a_save_in_flight_writes_its_step_s_state_as_a_synchronous_save_would(tmp_path):
    """The training thread changes the weights and the optimizer's moments in place while the write is held back:
    the files hold the state at the save, as save_model writes it (tied weights once, under the same name)."""
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    model.embed.weight.sum().backward()
    optimizer.step()
    expected_state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    save_model(model, str(tmp_path / "expected.safetensors"), metadata={"format": "pt"})
    release = threading.Event()

    def write(weights, state, moments):
        release.wait()
        save_model(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        torch.save(state, tmp_path / "state.pt")

    background = BackgroundSave(torch.device("cpu"))
    background.prepare(7, model, {"optimizer": optimizer.state_dict(), "step": 7}, write)
    background.go()  # (once every rank prepared: checkpoint.save)
    optimizer.step()  # the next step, while the save is in flight
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    release.set()
    background.wait()
    written, expected = (safe_open(tmp_path / name, "pt") for name in ("model.safetensors", "expected.safetensors"))
    assert written.metadata() == expected.metadata() and written.keys() == expected.keys() == ["decode.weight"]
    assert torch.equal(written.get_tensor("decode.weight"), expected.get_tensor("decode.weight"))
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert saved["step"] == 7
    assert all(torch.equal(saved["optimizer"]["state"][0][k], v) for k, v in expected_state.items())


def test_a_failed_background_write_is_raised_by_the_next_wait_naming_its_step():
    background = BackgroundSave(torch.device("cpu"))

    def write(weights, state, moments):
        raise OSError(28, "No space left on device")

    background.prepare(12, torch.nn.Linear(2, 2), {}, write)
    background.go()
    with pytest.raises(RuntimeError, match="checkpoint of step 12, written in the background, failed: OSError"):
        background.wait()
    background.wait()  # raised once


def test_a_save_copies_and_starts_its_writer_only_once_every_rank_made_its_buffers():
    """prepare() waits for the save before and makes the host buffers (what may fail, before the ranks agree), go()
    copies and starts the writer: on CUDA the agreement (NCCL) would wait for copies queued before it, and under
    strategy=fsdp a writer started before it would wait in DCP's collectives for a rank whose buffers failed."""
    model, written = torch.nn.Linear(2, 2), []
    background = BackgroundSave(torch.device("cpu"))
    background.prepare(3, model, {"step": 3}, lambda weights, state, moments: written.append(weights.state_dict()))
    with torch.no_grad():
        model.weight.fill_(7.0)  # (the state at go() is the step's: nothing runs between the two)
    assert background._thread is None and not written
    background.go()
    background.wait()
    assert torch.equal(written[0]["weight"], torch.full((2, 2), 7.0)) and background._thread is None


def test_a_half_written_checkpoint_is_never_chosen(tmp_path):
    """A write that ends half way (a process killed in it, here an error after the weights) leaves
    checkpoints/.tmp-<step>: the resume takes the newest complete checkpoint, and clears the rest."""
    model, warnings = torch.nn.Linear(2, 2), []
    checkpoint._write(tmp_path, 2, model, {"step": 2}, keep=2, model_files=None, also_keep=None)

    def killed(directory):
        raise SystemExit("killed mid-write")

    with pytest.raises(SystemExit):
        checkpoint._write(tmp_path, 4, model, {"step": 4}, keep=2, model_files=killed, also_keep=None)
    assert (tmp_path / "checkpoints" / ".tmp-4" / "model.safetensors").is_file()
    assert not (tmp_path / "checkpoints" / ".tmp-4" / MARKER).exists() and complete_steps(tmp_path) == [2]
    assert checkpoint._resume_point(tmp_path, warnings.append) == (2, None)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"] and not warnings


@pytest.mark.slow
def test_a_400_mb_state_saved_every_4_steps_stands_the_step_still_for_a_fraction_of_its_write(tmp_path):
    """An MLP of 34M fp32 parameters with AdamW: 405 MB of weights and moments. Saved at steps 4 and 8 in the
    background, each save stands the step still (ckpt_wait_s) for at most half of what a synchronous save of as
    many bytes (checkpoint._write: files, checksums, fsync) takes on this machine, measured here: the step waits
    for the host copy, not for the write."""
    run_dir = tmp_path / "run"
    out = run_cli("+exp=toy", "launcher.nproc_per_node=1", "model.hidden=5800", "model.depth=3",
                  "train.global_batch_size=16", "train.micro_batch_size=16", "train.max_steps=12", "train.ckpt_every=4",
                  "train.log_every=1", "train.eval_every=0", "data.sleep_s=0.7", f"hydra.run.dir={run_dir}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    saved = run_dir / "checkpoints" / "12"
    assert sum(f.stat().st_size for f in saved.iterdir()) > 400e6
    waits = {m["step"]: m["ckpt_wait_s"] for m in read_metrics(run_dir) if "ckpt_wait_s" in m}
    weights_like = HostWeights({"w": torch.rand((saved / "model.safetensors").stat().st_size // 4)})
    state_like = {"moments": torch.rand((saved / "train_state.pt").stat().st_size // 4)}
    synchronous = []
    for step in (1, 2):  # (keep=1: the second write also deletes the first, as a rotation does)
        began = time.perf_counter()
        checkpoint._write(tmp_path / "sync", step, weights_like, state_like, keep=1, model_files=None, also_keep=None)
        synchronous.append(time.perf_counter() - began)
    per_save = statistics.mean([waits[5], waits[9]])  # the saves of steps 4 and 8, counted in the next interval
    assert per_save <= 0.5 * min(synchronous), (waits, synchronous)
    assert waits[5] > 0 and not any(waits[s] for s in waits if s not in (5, 9)), waits
    print(f"\n400 MB state: a background save stood the step still {per_save:.2f} s; a synchronous save took "
          f"{min(synchronous):.2f} s")


KILLED = ("+exp=toy", "train.max_steps=40", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=2",
          "train.global_batch_size=16", "train.micro_batch_size=4", *SLOW, *DROPOUT, "data.save_sleep_s=0.15")


def launch(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", *on_the_cpu_plan([*KILLED, f"hydra.run.dir={run_dir}"])],
                            cwd=run_dir.parent, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_kill_9_while_background_writes_run_then_relaunch_ends_bitwise_equal(tmp_path):
    """Every 2 steps a save whose write takes rank 0 over 0.15 s (data.save_sleep_s): the launcher is killed outright
    at 5 instants while a write runs, each at a later save, and launched again each time; the run ends with the
    weights of the uninterrupted run (dropout: every rank's random stream goes on exactly too)."""
    run_dir, killed_at, torn = tmp_path / "run", [], 0

    def writing() -> list[int]:
        return [int(p.name[5:]) for p in (run_dir / "checkpoints").glob(".tmp-*")] if run_dir.exists() else []

    while len(killed_at) < 5:
        proc = launch(run_dir)
        wait_until(lambda: any(s > max(killed_at, default=0) for s in writing()) or proc.poll() is not None)
        assert proc.poll() is None, "the run ended before a write was seen"
        workers = [worker_pid(proc.pid, rank) for rank in (0, 1)]
        in_flight = max(writing())
        time.sleep(random.uniform(0, 0.1))
        proc.kill()
        proc.communicate(timeout=30)
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), timeout=30)
        left = writing()  # a later save may have begun in the instants before the kill: its temp dir stays too
        torn += in_flight in left
        killed_at.append(max([in_flight, *left]))  # so the next launch waits for a write of its own
    assert torn >= 1, killed_at  # at least one kill left a half-written checkpoint behind
    out = finish(launch(run_dir), 0)
    assert "resumed from step" in out
    uninterrupted = tmp_path / "uninterrupted"
    finish(launch(uninterrupted), 0)
    assert bitwise_equal(weights(run_dir, 40), weights(uninterrupted, 40)), killed_at
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 40
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
