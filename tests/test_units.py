"""In-process unit tests: batch math, the data plan and its loader, the schedule (PITFALLS #15 #16, issue 2)."""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.derived import ConfigError, grad_accum_steps
from launcher.train.data import DataPlan, StepWindows, rank_seed, rank_share, window_loader
from launcher.train.schedule import lr_factor


def test_grad_accum_is_derived_and_the_error_names_both_keys() -> None:
    assert grad_accum_steps(32, 4, 2) == 4
    with pytest.raises(ConfigError, match=r"train\.global_batch_size=30 .*train\.micro_batch_size=4"):
        grad_accum_steps(30, 4, 2)


def test_epochs_reshuffle_reproducibly_per_seed() -> None:
    plan = DataPlan(n_samples=100, global_batch_size=10, seed=3, drop_last=False)
    epoch0 = torch.cat([plan.step_indices(s) for s in range(10)])
    epoch1 = torch.cat([plan.step_indices(s) for s in range(10, 20)])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(100))
    assert not torch.equal(epoch0, epoch1)
    again = DataPlan(n_samples=100, global_batch_size=10, seed=3, drop_last=False)
    assert torch.equal(epoch0, torch.cat([again.step_indices(s) for s in range(10)]))
    other_seed = DataPlan(n_samples=100, global_batch_size=10, seed=4, drop_last=False)
    assert not torch.equal(epoch0, torch.cat([other_seed.step_indices(s) for s in range(10)]))


def test_short_last_window_and_drop_last() -> None:
    keep = DataPlan(n_samples=60, global_batch_size=16, seed=0, drop_last=False)
    drop = DataPlan(n_samples=60, global_batch_size=16, seed=0, drop_last=True)
    assert keep.steps_per_epoch == 4 and drop.steps_per_epoch == 3
    assert [len(keep.step_indices(s)) for s in range(5)] == [16, 16, 16, 12, 16]
    assert keep.epoch_of(3) == 0 and keep.epoch_of(4) == 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_shares_partition_the_step_for_any_world_size(world_size: int) -> None:
    """The step's samples do not depend on the world size: the shares are a partition of them."""
    plan = DataPlan(n_samples=60, global_batch_size=16, seed=0, drop_last=False)
    for step in range(8):
        indices = plan.step_indices(step)
        shares = [rank_share(indices, r, world_size) for r in range(world_size)]
        assert torch.equal(torch.cat(shares), indices)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_resumed_stream_equals_the_uninterrupted_one() -> None:
    """The stream is a function of the step, so starting at step 7 continues it exactly (PITFALLS #15)."""
    plan = DataPlan(n_samples=50, global_batch_size=8, seed=1, drop_last=False)
    uninterrupted = [plan.step_indices(s).tolist() for s in range(20)]
    resumed = DataPlan(50, 8, 1, False)
    assert [resumed.step_indices(s).tolist() for s in range(7, 20)] == uninterrupted[7:]


class AugmentingTask:
    """A job that draws random numbers in collate, from torch, random and numpy (augmentation)."""

    train_set = [{"id": i} for i in range(64)]

    def collate(self, samples: list[dict]) -> dict:
        return {"id": torch.tensor([s["id"] for s in samples]), "noise": torch.stack(
            [torch.rand(()), torch.tensor(random.random()), torch.tensor(np.random.rand())]).expand(len(samples), 3)}

    def count_items(self, batch: dict) -> torch.Tensor:
        return torch.tensor(len(batch["id"]))


def drawn(num_workers: int, steps: range, rank: int = 1, seed: int = 3) -> list[list[torch.Tensor]]:
    windows = StepWindows(AugmentingTask(), DataPlan(64, 8, seed=seed, drop_last=False), rank, world_size=2,
                          grad_accum_steps=2)
    return [[b["noise"] for b in w.micro_batches] for w in window_loader(windows, steps, num_workers, False)]


def test_collate_in_loader_processes_draws_the_same_for_a_step_after_a_resume() -> None:
    """What collate draws in a loader process is a function of (seed, rank, step): a loader started at step 3
    (a resume) or with another number of processes draws what the first run drew for steps
    3-5. In the rank's own process collate draws from the rank's stream, which a checkpoint carries:
    that stream is not reseeded (it would repeat dropout masks)."""
    uninterrupted = drawn(2, range(6))
    for resumed in (drawn(2, range(3, 6)), drawn(1, range(3, 6))):
        for a, b in zip(uninterrupted[3:], resumed, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(uninterrupted[3][0], uninterrupted[4][0])  # a new draw per step
    assert not torch.equal(drawn(2, range(3, 4), rank=0)[0][0], uninterrupted[3][0])  # and per rank (PITFALLS #17)
    torch.manual_seed(5)
    in_process = drawn(0, range(1))[0][0][0, 0]
    torch.manual_seed(5)
    assert in_process == torch.rand(())  # the rank's stream, continued


def test_every_seed_the_parent_takes_gives_seeds_torch_takes() -> None:
    """train.seed up to 2**32 - 1 (the parent refuses more): the ranks' derived seeds fit torch's generators
    (1e8 overflowed them in the loader's generator, a one-rank traceback), and small seeds keep their streams."""
    largest = 2**32 - 1
    assert drawn(1, range(2), seed=largest) and drawn(0, range(2), seed=largest)
    torch.manual_seed(rank_seed(largest, 4095, 10**9))
    for seed in (3, 10_000_000):  # a seed whose derived seeds fitted (10^7's: above 2**63) keeps them
        assert rank_seed(seed, 1, 500) == (seed * 1_000_003 + 1) * 1_000_003 + 500


def test_schedules() -> None:
    assert [lr_factor(s, "constant", 2, 10, 0.0) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(10, "linear", 0, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(5, "cosine", 0, 10, 0.0) == pytest.approx(0.5)
    assert lr_factor(10, "cosine", 0, 10, 0.0) == pytest.approx(0.0)


def test_worker_environment_per_plan_and_put_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A CPU plan's workers see no GPU; a CUDA plan's record their collectives in NCCL's flight recorder and dump it
    into the run dir, under the names this torch reads (CI runs this on torch 2.6 too), unless the user set them. The
    parent gets its own environment back: the next point of a local -m sweep (the same process) plans with the GPUs."""
    from launcher.launch.local import environment, worker_env
    from launcher.launch.plan import Plan

    cpu, cuda = Plan(1, 2, 2, 1, "cpu"), Plan(1, 2, 2, 1, "cuda")
    for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    # torch 2.6 and 2.7 read only the TORCH_NCCL_ names (their libtorch has no other), 2.8 on the TORCH_FR_ ones
    prefix = "TORCH_NCCL_" if torch.__version__.split("+")[0] in ("2.6.0", "2.7.0", "2.7.1") else "TORCH_FR_"
    names = ("BUFFER_SIZE", "DUMP_TEMP_FILE") if prefix == "TORCH_FR_" else ("TRACE_BUFFER_SIZE", "DEBUG_INFO_TEMP_FILE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setenv("LAUNCHER_LAUNCH_TIME", "1234.5")  # (python -m launcher sets it when it starts)
    # the workers end with this process, count their start-up from the launch and share the cores (compiling too)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    agent = {"LAUNCHER_AGENT_PID": str(os.getpid()), "LAUNCHER_LAUNCH_TIME": "1234.5", "OMP_NUM_THREADS": share,
             "TORCHINDUCTOR_COMPILE_THREADS": share}
    assert worker_env(cpu, tmp_path) == {**agent, "CUDA_VISIBLE_DEVICES": ""}
    assert worker_env(cuda, tmp_path) == {**agent, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                          "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", prefix + names[0]: "2000",
                                          prefix + names[1]: str(tmp_path / "comm_traces" / "rank_")}
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/scratch/fr_")  # the user's, in the older spelling
    monkeypatch.setenv(prefix + names[0], "0")  # the user's: no recording
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")  # the user's, newer spelling
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own threads per worker, and compile workers:
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")
    assert worker_env(cuda, tmp_path) == {**{k: v for k, v in agent.items() if not k.endswith("_THREADS")},
                                          "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    for before in (None, "0,1"):
        if before is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
        with environment(worker_env(cpu, tmp_path)):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_mfu_has_no_peak_where_none_is_known() -> None:
    """A CPU has no known peak, and fp32 without TF32 runs 7-15x under a GPU's TF32 peak: null, not invented
    (the device is not touched: this runs without a GPU)."""
    from launcher.train.meter import peak_flops

    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert peak_flops(torch.device("cuda", 0), "fp32", tf32=False) is None


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("NVIDIA L40", 181e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H20", None),
    ("Tesla V100-SXM2-32GB", 125e12), ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None)])
def test_mfu_takes_the_peak_of_the_gpu_named_and_of_no_other(name: str, peak: float | None) -> None:
    """The GPU's model as a whole word of its name: an A10G (about half an A10's peak) or an H20 gets none, rather
    than the peak of the GPU whose name starts like its own; so does a MIG slice (a fraction of its GPU's)."""
    from launcher.train.meter import peak_of_gpu

    assert peak_of_gpu(name) == peak


@pytest.mark.parametrize("tf32", [True, False])
def test_train_tf32_sets_matmuls_and_convolutions_alike_on_cuda(tf32: bool) -> None:
    """train.tf32=false turns off cuDNN's TF32 too, which torch's default leaves on (exact fp32 convolutions);
    a CPU plan leaves both flags alone. (The flags exist without a GPU; the device is not touched.)"""
    from launcher.train.precision import Precision

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
        Precision("fp32", "cpu", tf32).apply_tf32()
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (not tf32, not tf32)
        Precision("fp32", "cuda", tf32).apply_tf32()
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_slurm_rendezvous_ports_differ_by_job_and_requeue_and_stay_below_ephemeral_ports() -> None:
    """PITFALLS #22 on Slurm: jobs sharing a node rendezvous on ports of their own. Array tasks whose ids have
    the same digits (1_23, 12_3) get two ports, and every port is below Linux's ephemeral range (32768 on)."""
    from launcher.launch.slurm import rendezvous_port

    assert rendezvous_port("1_23", 0) != rendezvous_port("12_3", 0) != rendezvous_port("123", 0)
    assert rendezvous_port("4711", 0) != rendezvous_port("4711", 1)
    ports = {rendezvous_port(f"{job}_{task}", restart) for job in range(1000, 1020) for task in range(50)
             for restart in range(2)}
    assert min(ports) >= 20000 and max(ports) < 32768 and len(ports) > 1500  # 2000 ids, few collisions


def test_a_dropped_step_attempt_is_not_compute_of_the_straggler_interval() -> None:
    """A step redone after running out of memory (train_step drops its timed attempt): the straggler metric
    compares what the ranks spent on the steps that counted."""
    from launcher.train.straggler import ComputeTimer

    timer = ComputeTimer(torch.device("cpu"), rank=0, world_size=2)
    for seconds in (0.02, 0.3):
        timer.start()
        time.sleep(seconds)
        timer.stop()
    timer.drop_last()
    assert 0.02 <= timer.host_s < 0.2


def test_one_node_claims_the_requeue_of_an_attempt(tmp_path: Path) -> None:
    """Several nodes can run out of memory in one attempt (in eval, every rank alike): one requeues it, so the
    count in requeues.json goes up by one and no second `scontrol requeue` fails. The next attempt has its own."""
    from launcher.launch.slurm import first_to_requeue

    assert [first_to_requeue(tmp_path, "17_3", 0) for _ in range(3)] == [True, False, False]
    assert first_to_requeue(tmp_path, "17_3", 1) and first_to_requeue(tmp_path, "18", 0)


def test_max_requeues_counts_per_submitted_job(tmp_path: Path) -> None:
    """A run dir resubmitted after its job used up launcher.max_requeues: the new job may requeue itself again (it
    failed at its first preemption)."""
    from launcher.launch.slurm import REQUEUES_FILE, requeues_so_far

    (tmp_path / REQUEUES_FILE).write_text(json.dumps({"job_id": "12", "count": 3}))
    assert requeues_so_far(tmp_path, "12") == 3 and requeues_so_far(tmp_path, "29") == 0
    (tmp_path / REQUEUES_FILE).write_text(json.dumps({"count": 3}))  # written before the job's id was in it
    assert requeues_so_far(tmp_path, "29") == 0


def test_a_ranks_error_is_told_by_its_line_that_says_what_failed() -> None:
    """OmegaConf's errors end in indented details: the launcher's line said `object_type=dict` and nothing else."""
    from launcher.launch.local import last_line

    omegaconf = "ConfigAttributeError: Missing key checkpoint_timeout_s\n    full_key: dist.x\n    object_type=dict"
    assert last_line(omegaconf) == "ConfigAttributeError: Missing key checkpoint_timeout_s"
    assert last_line("ValueError: one line") == "ValueError: one line"
    assert last_line("RuntimeError: first\nsecond") == "second"


def test_status_tells_a_run_that_slurm_here_cannot_by_its_run_dir_and_keeps_each_sweep_together(tmp_path: Path) -> None:
    """Without sacct and squeue (another host, a forgotten job) a finished run said UNKNOWN; sweeps side by side
    were listed point by point, interleaved (a/0, b/0, a/1, b/1). Another program's config.yaml below is no run (it
    crashed the table)."""
    from launcher.launch.status import describe, run_dirs

    for sweep in ("a", "b"):
        for point in ("0", "1", "10"):
            (tmp_path / sweep / point).mkdir(parents=True)
            (tmp_path / sweep / point / "config.yaml").write_text("{}\n")
            (tmp_path / sweep / point / "launch.json").write_text("{}\n")
    for other in ("a/0/.hydra", "models/bert"):
        (tmp_path / other).mkdir(parents=True)
        (tmp_path / other / "config.yaml").write_text("[not: yaml of ours\n")
    assert [str(p.relative_to(tmp_path)) for p in run_dirs(tmp_path)] == ["a/0", "a/1", "a/10", "b/0", "b/1", "b/10"]
    done, gone = tmp_path / "a" / "0", tmp_path / "a" / "1"
    (done / "summary.json").write_text("{}\n")
    assert describe(done, "5", {"5": "UNKNOWN"})["state"] == "DONE"
    assert describe(gone, "6", {"6": "UNKNOWN"})["state"] == "UNKNOWN"
    assert describe(done, "5", {"5": "COMPLETED"})["state"] == "COMPLETED"


def test_a_sweep_point_s_hints_name_the_sweep_dir(tmp_path: Path) -> None:
    """A finished sweep said "use a new hydra.run.dir", which a sweep does not read: its points' dirs come from
    hydra.sweep.dir."""
    import copy
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from conftest import CONF
    from launcher.launch.resume import finished

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+exp=toy"], return_hydra_config=True)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 5, "final_loss": 0.25, "eval": {"loss": 0.5}}))
    config = {"resume": {"mode": "auto"}, "train": {"max_steps": 5}}
    try:
        for mode, key in ((RunMode.RUN, "hydra.run.dir"), (RunMode.MULTIRUN, "hydra.sweep.dir")):
            point = copy.deepcopy(cfg)  # (set_config makes what it is given read-only)
            point.hydra.mode = mode
            HydraConfig.instance().set_config(point)
            said = finished(tmp_path, config, 5)
            assert said.startswith(f"run dir {tmp_path} already finished: 5 steps") and said.endswith(
                f"to train again, use a new {key})"), said
    finally:
        HydraConfig.instance().cfg = None
