"""Sampling whose cost does not grow with the data set (issue 38): a step's samples read from a seeded permutation
of [0, n) in O(global batch), a pure function of (seed, epoch, step, global batch) as before; a train set of 10^9
samples steps as fast, starts as soon and uses no more memory than one of 10^3; a run dir started with the old order
(torch.randperm of the whole set at every step) goes on with it."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, run_cli
from helpers import sample_stream
from launcher.train.data import DataPlan
from launcher.train.sample_order import epoch_key, permuted


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 255, 1000, 4099])
def test_every_epoch_is_a_permutation_of_the_train_set(n: int) -> None:
    for seed, epoch in ((0, 0), (0, 1), (7, 3)):
        order = permuted(torch.arange(n), n, epoch_key(seed, epoch))
        assert sorted(order.tolist()) == list(range(n)) and order.dtype == torch.int64


def test_orders_differ_by_epoch_and_seed_and_no_position_is_favoured() -> None:
    n = 10_000
    orders = {(s, e): permuted(torch.arange(n), n, epoch_key(s, e)) for s in (0, 1) for e in (0, 1)}
    assert len({tuple(o.tolist()) for o in orders.values()}) == 4
    fixed_points = [(o == torch.arange(n)).sum().item() for o in orders.values()]
    assert max(fixed_points) < 10  # about one expected of a random permutation
    first_tenth = orders[(0, 0)][: n // 10].float()  # the first samples of an epoch come from all over the set
    assert 0.4 * n < first_tenth.mean() < 0.6 * n


def test_a_step_of_a_billion_sample_set_costs_its_batch_not_the_set() -> None:
    """torch.randperm(10^9) takes seconds and 8 GB; a step's 512 positions of the permutation take milliseconds."""
    plan = DataPlan(n_samples=10**9, global_batch_size=512, seed=0, drop_last=False)
    began = time.perf_counter()
    indices = [plan.step_indices(step) for step in (0, 1, 1_000_000, plan.steps_per_epoch - 1, plan.steps_per_epoch)]
    assert time.perf_counter() - began < 2.0
    assert [len(i) for i in indices] == [512, 512, 512, 10**9 - 512 * (plan.steps_per_epoch - 1), 512]
    assert all(0 <= int(i.min()) and int(i.max()) < 10**9 for i in indices)


def test_the_old_order_is_torch_randperm_of_the_whole_set() -> None:
    old = DataPlan(n_samples=100, global_batch_size=16, seed=3, drop_last=False, order="randperm")
    generator = torch.Generator().manual_seed(3 * 1_000_003 + 1)  # epoch 1: steps 7..13
    assert torch.equal(old.step_indices(8), torch.randperm(100, generator=generator)[16:32])


def steady_run(tmp_path: Path, name: str, n_samples: int) -> tuple[dict, list[float], float]:
    """The toy with a lazily made train set of n_samples, steps of about 20 ms (the loss sleeps 10 ms per
    micro-batch, as a real model computes): its summary, the log intervals' samples/s and the launch time."""
    run_dir = tmp_path / name
    began = time.time()
    out = run_cli("+exp=toy", "data.lazy=true", f"data.n_samples={n_samples}", "data.sleep_s=0.01",
                  "train.max_steps=60", "train.log_every=10", "train.eval_every=0", f"hydra.run.dir={run_dir}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rates = [m["samples_per_sec"] for m in read_metrics(run_dir) if "loss" in m][1:]
    return summary, rates, summary["first_step_unix_time"] - began


@pytest.mark.slow
def test_a_billion_samples_train_like_a_thousand(tmp_path: Path) -> None:
    small, small_rates, small_start = steady_run(tmp_path, "thousand", 10**3)
    large, large_rates, large_start = steady_run(tmp_path, "billion", 10**9)
    slower = sorted(small_rates)[len(small_rates) // 2] / sorted(large_rates)[len(large_rates) // 2]
    assert slower <= 1.3, (small_rates, large_rates)
    assert large_start <= small_start + 10, (small_start, large_start)
    assert large["peak_mem_mb"] <= small["peak_mem_mb"] + 100, (small["peak_mem_mb"], large["peak_mem_mb"])


def without_sample_order(checkpoint: Path) -> None:
    """Make a checkpoint as the launcher wrote it before the order was recorded: no sample_order in its train
    state, and the marker's checksum of that file updated (else the resume would refuse it as damaged)."""
    state_file = checkpoint / "train_state.pt"
    state = torch.load(state_file, weights_only=True)
    del state["sample_order"]
    torch.save(state, state_file)
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["sha256"]["train_state.pt"] = hashlib.sha256(state_file.read_bytes()).hexdigest()
    (checkpoint / "COMPLETE").write_text(json.dumps(marker) + "\n")


@pytest.mark.slow
def test_a_run_started_with_the_old_order_goes_on_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = ("+exp=toy", "train.global_batch_size=16", "train.micro_batch_size=8", "train.log_samples=true",
              f"hydra.run.dir={run_dir}")
    out = run_cli(*common, "train.max_steps=4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    new_order = DataPlan(n_samples=1024, global_batch_size=16, seed=0, drop_last=False)
    assert sample_stream(run_dir) == [(s + 1, new_order.step_indices(s).tolist()) for s in range(4)]
    without_sample_order(run_dir / "checkpoints" / "4")
    out = run_cli(*common, "train.max_steps=8", "resume.allow_config_change=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "this run continues in the sample order it started with (randperm" in out.stdout
    old_order = DataPlan(n_samples=1024, global_batch_size=16, seed=0, drop_last=False, order="randperm")
    assert sample_stream(run_dir)[4:] == [(s + 1, old_order.step_indices(s).tolist()) for s in range(4, 8)]
