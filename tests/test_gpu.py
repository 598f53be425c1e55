"""The CUDA path end to end on real GPUs (issue 10): NCCL, autocast, GradScaler, compile, pinned loading,
checkpoints. `python -m pytest -m gpu` runs only these. They skip, saying why, where torch sees no GPU
(CI has none); the two-rank NCCL test skips unless 2 GPUs are visible.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from conftest import read_metrics, run_cli
from helpers import (DROPOUT, FP16, SLOW, assert_params_close, bitwise_equal, finish, probe, sample_stream, start, train_cli,
                     wait_until, weights, worker_pid)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none")]
ONE_GPU = ("launcher.device=cuda", "launcher.nproc_per_node=1")


def run_ok(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    out = run_cli(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return run_dir


def test_toy_on_one_gpu_trains_evaluates_and_checkpoints(tmp_path: Path) -> None:
    """The crash users saw first: the final eval stacked CUDA sums with a CPU count."""
    run_dir = run_ok(tmp_path, "+exp=toy", *ONE_GPU, "train.max_steps=40", "train.eval_every=20")
    plan = OmegaConf.load(run_dir / "config.yaml").plan
    assert (plan.device_type, plan.world_size) == ("cuda", 1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["eval"]["loss"] > 0 and summary["peak_mem_mb"] > 0
    assert [m["step"] for m in read_metrics(run_dir) if "eval" in m] == [20, 40]
    assert (run_dir / "checkpoints" / "40" / "COMPLETE").exists()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_bert_on_one_gpu(tmp_path: Path, tiny_bert: Path, precision: str) -> None:
    """+exp=bert on a BERT written by save_pretrained with the real tokenizer files, eval included."""
    run_dir = run_ok(tmp_path, "+exp=bert", f"model.pretrained={tiny_bert}", *ONE_GPU, f"precision={precision}",
                     "train.max_steps=30", "train.eval_every=15", "data.n_train=400", "data.n_eval=101")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"] == precision and 0 <= summary["eval"]["accuracy"] <= 1
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert steps[-1]["tokens_per_sec"] > 0 and ("loss_scale" in steps[-1]) == (precision == "fp16")


@pytest.mark.parametrize("precision,compiled,reduce_every", [("bf16", False, False), ("fp16", False, False),
                                                            ("bf16", True, False), ("fp16", False, True)],
                         ids=["bf16", "fp16", "bf16-compiled", "fp16-reduce-every-micro-batch"])
def test_fsdp_on_one_gpu(tmp_path: Path, tiny_bert: Path, precision: str, compiled: bool, reduce_every: bool) -> None:
    """strategy=fsdp on CUDA: FSDP2's 16-bit gathers and float32 reduction, GradScaler on its DTensor gradients, each
    block compiled by inductor's Triton kernels, and checkpoints of full tensors that transformers loads, written
    in the background while training goes on (the shards from pinned copies queued behind the step), each naming
    the float32 of its weights though the module holds 16-bit copies mid-step; with strategy.reduce_every_micro_batch
    the scaled gradients of each of the 4 micro-batches reduce-scattered into the shards."""
    run_dir = run_ok(tmp_path, "+exp=bert", f"model.pretrained={tiny_bert}", *ONE_GPU, f"precision={precision}",
                     "strategy=fsdp", f"train.compile={str(compiled).lower()}", "train.max_steps=20",
                     f"strategy.reduce_every_micro_batch={str(reduce_every).lower()}",
                     "train.ckpt_every=5", "train.keep_checkpoints=4", "data.n_train=400", "data.n_eval=101")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["strategy"], summary["precision"]) == ("fsdp", precision) and summary["skipped_steps"] < 20
    assert summary["state_bytes_per_rank"]["optimizer"] > 0 and 0 <= summary["eval"]["accuracy"] <= 1
    configs = [json.loads((run_dir / "checkpoints" / str(step) / "config.json").read_text())
               for step in (5, 10, 15, 20)]
    assert [config.get("dtype", config.get("torch_dtype")) for config in configs] == ["float32"] * 4  # (transformers 4)
    transformers.AutoModelForSequenceClassification.from_pretrained(run_dir / "checkpoints" / "20")
    assert (summary.get("compiled_graphs", 0) >= 1) == compiled
    assert ("each micro-batch's gradients reduce-scattered" in (run_dir / "launcher.log").read_text()) == reduce_every


def test_fp16_overflow_on_cuda_skips_halves_the_scale_and_holds_the_scheduler(tmp_path: Path) -> None:
    (rank,) = probe(tmp_path, 1, "fp16", *ONE_GPU, "precision=fp16", "precision.init_scale=1024",
                    "scheduler=linear", "scheduler.warmup_steps=3", "train.max_steps=6", inf_step=3)
    steps = rank["steps"]
    assert [s["stepped"] for s in steps] == [True, True, True, False, True, True]
    bad, before = steps[3], steps[2]
    assert bad["scale_after"] == bad["scale_before"] / 2 == 512
    assert bad["sched_after"] == bad["sched_before"] == 3 and bad["lr"] == before["lr"]
    assert bad["params"] == before["params"]  # the fused optimizer really did not step


EAGER = ("train.compile=false",)  # train.compile=auto compiles on a GPU
# 1 MB buckets: dynamo cuts the small BERT in pieces where asked to (one node compiles one graph by default)
COMPILED = ("train.compile=true", "dist.bucket_cap_mb=1", "train.compile_ddp_split=true")


@pytest.mark.parametrize("exp,precision,compiled", [
    ("toy", "fp32", EAGER), ("toy", "fp16", EAGER), ("bench", "bf16", EAGER), ("bench", "fp16", EAGER),
    ("bench", "fp16", COMPILED), ("bench", "fp16", ("dist.bucket_cap_mb=1",))],
    ids=["toy-fp32", "toy-fp16", "bench-bf16", "bench-fp16", "bench-fp16-compiled", "bench-fp16-compiled-whole"])
def test_a_steady_step_never_waits_for_the_gpu(tmp_path: Path, exp: str, precision: str, compiled: tuple) -> None:
    """Issue 11: under torch.cuda.set_sync_debug_mode("error") five steps that neither log, evaluate nor
    checkpoint run through (pinned loading, the step, the meter); a GPU read there does raise. BERT
    (bench) needs transformers 5: 4.x's BERT checks its attention mask on the GPU in every forward.
    Compiled: in dynamo's pieces at DDP's buckets (train.compile_ddp_split=true), and as the defaults compile it on
    one GPU, one graph."""
    if exp == "bench" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__}'s BERT syncs on its attention mask (5.x does not)")
    small_bert = ("model.layers=2", "model.hidden=128", "model.heads=2", "data.seq_len=64", "data.n_samples=256")
    (rank,) = probe(tmp_path, 1, "syncfree", *ONE_GPU, f"precision={precision}", "train.max_steps=8",
                    *(small_bert if exp == "bench" else ()), *compiled, exp=exp)
    assert rank["steps_without_sync"] == 5 and rank["control_raised"]
    if compiled == EAGER:
        assert rank["compiled_pieces"] is None
    elif compiled == COMPILED:
        assert rank["compiled_pieces"] > 1
    else:  # the defaults: compiled (auto), one graph on one node
        assert rank["compiled_pieces"] == 1


@pytest.mark.parametrize("exp", ["toy", "bench", "bert", "bert-checkpointed"])
def test_the_loop_s_steady_steps_never_wait_for_the_gpu(tmp_path: Path, tiny_bert: Path, exp: str) -> None:
    """train.sync_check=error over the whole loop (pinned loading, the step, the meter, the ledger): the
    dispatcher and torch's own sync debug mode find nothing in steps 4, 5 and 7 to 11. bert: padded batches;
    checkpointed: each layer recomputed in the backward, the CUDA random state saved and restored for it."""
    if exp != "toy" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__}'s BERT syncs on its attention mask (5.x does not)")
    bert = ("precision=bf16", f"model.pretrained={tiny_bert}", "data.n_train=256", "data.n_eval=32")
    by_exp = {"toy": ("precision=fp16",),
              "bench": ("precision=bf16", "model.layers=2", "model.hidden=128", "model.heads=2", "data.seq_len=64",
                        "data.n_samples=256"),
              "bert": bert, "bert-checkpointed": (*bert, "model.activation_checkpointing=true")}
    run_dir = run_ok(tmp_path, f"+exp={exp.split('-')[0]}", *ONE_GPU, *by_exp[exp], "train.sync_check=error",
                     "train.max_steps=12", "train.log_every=6")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["host_syncs"], summary["checked_steps"]) == (0, 7)


def test_a_gpu_read_in_the_forward_is_counted_once_per_read(tmp_path: Path) -> None:
    """The control: the toy's .item() in its forward, 4 micro-batches in each of 7 checked steps, counted
    once each (by the dispatcher, not again by torch's own check) and named."""
    run_dir = tmp_path / "run"
    out = run_cli("+exp=toy", *ONE_GPU, "model.host_read=true", "train.sync_check=warn", "train.max_steps=12",
                  "train.log_every=6", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["host_syncs"] == 28
    assert "warning: step 4 waits for the GPU: " in out.stderr and "jobs/toy.py:" in out.stderr
    assert "is a prototype" not in out.stderr  # torch's note on its sync debug mode, once per rank before


def test_torch_s_own_sync_check_is_ours_on_cuda() -> None:
    """What only CUDA's sync debug mode sees (blocking copies to and from the GPU) is counted and placed at
    this file's line with warn, and is one line of ours with error; a device read the dispatcher counted
    is not counted again; a non_blocking copy is counted from unpinned memory only (the dispatcher's)."""
    from launcher.train.sync_check import UNPINNED_COPY, SyncCheck

    device = torch.device("cuda", 0)
    x, pinned, reported = torch.randn(8, device=device), torch.ones(8).pin_memory(), []
    check = SyncCheck("warn", device)
    with check.watching(4, reported.append):
        x.cpu()  # a blocking copy to the host
        x.sum().item()  # the dispatcher's, counted once
        torch.ones(8).to(device)  # from pageable memory: the copy waits
        torch.ones(8).to(device, non_blocking=True)  # may wait all the same, unseen by torch's check
        x.copy_(torch.ones(8), non_blocking=True)
        pinned.to(device, non_blocking=True)  # the launcher's way: no wait, not counted
        x.copy_(pinned, non_blocking=True)
        torch.ones(0).to(device, non_blocking=True)  # nothing to copy (an MLM batch with no masked token)
    assert check.syncs == 5 and len(reported) == 5, reported
    assert sum(UNPINNED_COPY in line for line in reported) == 2, reported
    assert all(line.startswith("warning: step 4 waits for the GPU: ") and "test_gpu.py:" in line for line in reported)
    with pytest.raises(RuntimeError, match=r"^step 5 waits for the GPU: .*test_gpu\.py:\d+ .*synchronizes"):
        with SyncCheck("error", device).watching(5, reported.append):
            x.cpu()
    assert torch.cuda.get_sync_debug_mode() == 0  # the check leaves the mode as it found it


def test_compile_on_cuda_trains(tmp_path: Path) -> None:
    run_dir = run_ok(tmp_path, "+exp=toy", *ONE_GPU, "train.compile=true", "train.max_steps=40", "train.log_every=5")
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert all((m["compiled_graphs"], m["graph_breaks"]) == (1, 0) for m in steps)  # nothing recompiles or breaks


def test_cuda_graph_mode_captures_every_graph_and_trains_like_the_default_mode(tmp_path: Path) -> None:
    """train.compile_mode=reduce-overhead with one micro-batch per step (the parent refuses accumulation):
    inductor skips no CUDA graph, step 30's trace replays graphs, and the losses are those of compile's
    default mode (the same kernels)."""
    one_micro_batch = ("+exp=toy", *ONE_GPU, "train.compile=true", "train.micro_batch_size=32", "train.max_steps=40",
                       "train.log_every=5")
    losses = {}
    for mode, profiled in (("default", ()), ("reduce-overhead", ("train.profile=[30,30]",))):
        (tmp_path / mode).mkdir()
        run_dir = run_ok(tmp_path / mode, *one_micro_batch, f"train.compile_mode={mode}", *profiled)
        steps = [m for m in read_metrics(run_dir) if "loss" in m]
        if mode == "reduce-overhead":  # every graph captured (not one skip), and replayed
            assert all(m["cudagraph_skips"] == 0 for m in steps)
            trace = json.loads(next((run_dir / "profile").glob("*.pt.trace.json")).read_text())
            assert any(event.get("name") == "cudaGraphLaunch" for event in trace["traceEvents"])
        losses[mode] = [m["loss"] for m in steps]
    assert losses["reduce-overhead"] == pytest.approx(losses["default"], rel=1e-4)


def test_loader_processes_hand_over_pinned_windows(tmp_path: Path) -> None:
    """On CUDA the loader pins each window (so the copy to the GPU can be non_blocking), in its own processes
    and in the rank's (train.num_workers=0, the default)."""
    from jobs.toy import ToyRegression
    from launcher.train.data import DataPlan, StepWindows, window_loader

    task = ToyRegression(n_samples=64, n_eval=0)
    windows = StepWindows(task, DataPlan(64, 16, 0, False), rank=0, world_size=1, grad_accum_steps=2)
    for num_workers in (0, 2):
        for window in window_loader(windows, range(3), num_workers=num_workers, pin_memory=True):
            assert all(t.is_pinned() for batch in window.micro_batches for t in batch.values())
    run_ok(tmp_path, "+exp=toy", *ONE_GPU, "train.num_workers=2", "train.max_steps=20")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-fsdp"])
def test_kill_and_resume_on_cuda_is_bitwise_exact(tmp_path: Path, precision: str) -> None:
    """SIGKILL the only worker after a checkpoint: torchrun restarts it, it resumes (CUDA RNG of its own
    device included: dropout draws from it in every forward; fused AdamW's state and step counts on the GPU;
    fp16's loss scale; under fsdp the moments' shards read into CUDA DTensors) and ends bitwise equal to an
    uninterrupted run."""
    mixed = {"fp32": ("precision=fp32",), "bf16": ("precision=bf16",), "fp16": FP16,
             "bf16-fsdp": ("precision=bf16", "strategy=fsdp")}[precision]
    reference = tmp_path / "reference"
    finish(start(reference, *ONE_GPU, *DROPOUT, *mixed), 0)
    killed = tmp_path / "killed"
    proc = start(killed, *ONE_GPU, *DROPOUT, *mixed, *SLOW, "launcher.max_restarts=1")
    wait_until(lambda: (killed / "checkpoints" / "40" / "COMPLETE").exists())
    time.sleep(0.1)
    os.kill(worker_pid(proc.pid, rank=0), signal.SIGKILL)
    finish(proc, 0)
    assert json.loads((killed / "summary.json").read_text())["restarts"] == 1
    assert bitwise_equal(weights(killed), weights(reference))
    assert sample_stream(killed) == sample_stream(reference)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a two-rank NCCL job")
def test_two_gpus_on_nccl_follow_the_one_gpu_trajectory(tmp_path: Path) -> None:
    common = ("launcher.device=cuda", "train.global_batch_size=8", "train.max_steps=30", "train.tf32=false")
    split = train_cli(tmp_path / "w2", *common, "launcher.nproc_per_node=2", "train.micro_batch_size=2")
    whole = train_cli(tmp_path / "w1", *common, "launcher.nproc_per_node=1", "train.micro_batch_size=8")
    assert_params_close(split, whole, rtol=1e-10)


def test_cpu_plan_on_a_gpu_host_hides_the_gpus(tmp_path: Path) -> None:
    """launcher.device=cpu: two gloo workers where a CUDA plan would refuse more workers than GPUs; the
    workers see no GPU, so they report no GPU peak (mfu null)."""
    run_dir = run_ok(tmp_path, "+exp=toy", "launcher.device=cpu", "launcher.nproc_per_node=2", "train.max_steps=10")
    assert OmegaConf.load(run_dir / "config.yaml").plan.device_type == "cpu"
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert [m.get("mfu") for m in read_metrics(run_dir) if "loss" in m][-1] is None  # a CPU run: no GPU peak


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_micro_batch_auto_probes_real_gpu_memory(tmp_path: Path, tiny_bert: Path, strategy: str) -> None:
    """Issue 12 on a GPU: the probe measures the job's longest batches against the GPU's memory (no CPU
    note), picks a size, records it, and the run trains with it. Under fsdp (issue 40) the peaks of sizes 1 and
    2, extrapolated, name the first size every rank tries together."""
    run_dir = run_ok(tmp_path, "+exp=bert", f"model.pretrained={tiny_bert}", *ONE_GPU, "train.micro_batch_size=auto",
                     f"strategy={strategy}", "train.max_steps=10", "data.n_train=400", "data.n_eval=101")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["micro_batch_size"] == 32 and summary["grad_accum_steps"] == 1  # a tiny BERT: the whole share
    why = json.loads((run_dir / "micro_batch.json").read_text())["why"]
    assert why == "tried rank 0: 32 fits" if strategy == "ddp" else \
        re.fullmatch(r"tried 1 and 2 to extrapolate: rank 0's peaks [0-9.]+, [0-9.]+ GiB point to 32, then 32 fits "
                     r"on every rank", why), why


def test_running_out_of_memory_on_cuda_redoes_the_step(tmp_path: Path) -> None:
    """The redo path with CUDA tensors: the host-side gloo agreement group, dropping the step, emptying the
    allocator's cache; the weights end as a run at micro-batch 8 throughout (float64, rtol 1e-10)."""
    common = ("+exp=toy", *ONE_GPU, "model.dtype=float64", "data.dtype=float64", "train.max_steps=12",
              "train.tf32=false", "train.eval_every=0")
    (tmp_path / "fixed").mkdir()
    (tmp_path / "auto").mkdir()
    whole = run_ok(tmp_path / "fixed", *common, "train.micro_batch_size=8")
    # one rank, share 32, micro-batch 8: 1 probe trial, then 4 loss computations per step; the 18th is step 5's
    redone = run_ok(tmp_path / "auto", *common, "train.micro_batch_size=auto", "train.max_micro_batch_size=8",
                    "data.oom_rank=0", "data.oom_max_items=4", "data.oom_from_call=18")
    assert [m["micro_batch_size"] for m in read_metrics(redone) if "loss" in m][-1] == 4
    for key, value in weights(whole, 12).items():
        torch.testing.assert_close(weights(redone, 12)[key], value, rtol=1e-10, atol=0)
