"""train.num_workers=auto (the default): windows made ahead of the step, and never other windows than the
training thread would make (launcher/train/prefetch.py)."""
from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics, run_cli
from jobs.toy import ToyRegression
from launcher.train.data import DataPlan, StepWindows, window_loader
from launcher.train.prefetch import AutoPrefetch, ThreadPrefetch, draws_from_global_streams, loader_processes

TOY = ("+exp=toy", "launcher.nproc_per_node=1", "train.eval_every=0", "train.log_every=10")


def test_a_draw_from_any_global_stream_is_seen_and_a_generator_s_is_not():
    assert draws_from_global_streams(lambda: torch.rand(2))[1]
    assert draws_from_global_streams(lambda: random.random())[1]
    assert draws_from_global_streams(lambda: np.random.rand())[1]
    generator = torch.Generator().manual_seed(0)
    result, drew = draws_from_global_streams(lambda: torch.rand(2, generator=generator) + 1)
    assert not drew and result.shape == (2,)


def test_loader_processes_only_where_two_cores_are_spare():
    assert [loader_processes(spare) for spare in (-3, 0, 1, 2, 3, 16)] == [0, 0, 0, 2, 3, 4]


def test_the_thread_keeps_order_raises_the_error_where_read_and_stops_early():
    def items():
        yield from range(5)
        raise ValueError("row 5: no text")

    ahead = ThreadPrefetch(items(), depth=2, device=torch.device("cpu"))
    seen = []
    with pytest.raises(ValueError, match="row 5"):
        seen.extend(ahead)
    assert seen == [0, 1, 2, 3, 4]

    made = []

    def endless():
        while True:
            made.append(len(made))
            yield made[-1]

    ahead = ThreadPrefetch(endless(), depth=2, device=torch.device("cpu"))
    assert next(iter(ahead)) == 0
    ahead.close()
    stopped_at = len(made)
    time.sleep(0.2)
    assert len(made) == stopped_at <= 4 and not any(t.name == "launcher-prefetch" for t in threading.enumerate())


def windows_of(task: ToyRegression, grad_accum_steps: int = 2) -> StepWindows:
    plan = DataPlan(n_samples=len(task.train_set), global_batch_size=16, seed=3, drop_last=False)
    return StepWindows(task, plan, rank=1, world_size=2, grad_accum_steps=grad_accum_steps)


@pytest.mark.parametrize("where", ["thread", "processes"])
def test_auto_makes_the_windows_the_training_thread_makes(where):
    """In a thread, and in loader processes (which CI's 2 cores never get under auto), the windows are those of
    train.num_workers=0, split again as a resplit asks."""
    task = ToyRegression(n_samples=200)
    said = []
    auto = AutoPrefetch(torch.device("cpu"), prefetch_factor=2, worker_init_fn=None, say=said.append)
    auto.processes = 2 if where == "processes" else 0
    windows = windows_of(task)
    made = list(auto(windows, range(0, 6)))
    assert auto.where == where and len(said) == 1 and where.split()[0] in said[0]
    windows.grad_accum_steps = 4  # a resplit after running out of memory: the next loader splits that way
    made += list(auto(windows, range(6, 9)))
    reference = [*window_loader(windows_of(task), range(0, 6), 0, False),
                 *window_loader(windows_of(task, 4), range(6, 9), 0, False)]
    assert len(made) == len(reference) == 9
    for ours, theirs in zip(made, reference):
        assert ours.sample_ids == theirs.sample_ids and len(ours.micro_batches) == len(theirs.micro_batches)
        for a, b in zip(ours.micro_batches, theirs.micro_batches):
            assert all(torch.equal(a[k], b[k]) for k in ("id", "x", "y"))


def test_a_collate_that_draws_from_the_global_stream_stays_on_the_training_thread():
    said = []
    auto = AutoPrefetch(torch.device("cpu"), prefetch_factor=2, worker_init_fn=None, say=said.append)
    list(auto(windows_of(ToyRegression(n_samples=64, collate_noise=0.1)), range(0, 3)))
    assert auto.where == "training thread" and "collate draws from the global random streams" in said[0]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "40" / "model.safetensors")


@pytest.mark.slow
def test_a_slow_collate_behind_a_longer_step_does_not_wait_under_the_defaults(tmp_path):
    """Collate 20 ms per micro-batch (two per window) behind an 80 ms step: with the defaults the step waits for
    almost nothing, and trains the weights of train.num_workers=0 (dropout draws from torch's global stream on the
    training thread meanwhile). A collate that draws from that stream itself stays on the training thread, where
    the step waits for every window."""
    slow = ("train.max_steps=40", "train.global_batch_size=32", "train.micro_batch_size=16", "data.collate_sleep_s=0.02",
            "data.sleep_s=0.04", "model.dropout=0.2")
    runs = {}
    for name, extra in (("auto", ()), ("zero", ("train.num_workers=0",)), ("noise", ("data.collate_noise=0.1",))):
        run_dir = tmp_path / name
        out = run_cli(*TOY, *slow, *extra, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        runs[name] = (run_dir, out.stdout + out.stderr)
    # the first interval holds the first window, made on the training thread where auto looks at what it draws
    wait = {name: statistics.median(r["data_wait_frac"] for r in read_metrics(run_dir)[1:] if "data_wait_frac" in r)
            for name, (run_dir, _) in runs.items()}
    assert wait["auto"] <= 0.05 and wait["zero"] >= 0.1 and wait["noise"] >= 0.1, wait
    assert "a background thread prepares windows ahead" in runs["auto"][1]
    assert "collate draws from the global random streams" in runs["noise"][1]
    a, b, noisy = (final_weights(runs[name][0]) for name in ("auto", "zero", "noise"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], noisy[k]) for k in a)  # what collate draws is trained on
