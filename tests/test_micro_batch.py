"""Issue 12: train.micro_batch_size=auto and running out of memory, with real torchrun + gloo ranks.

Out of memory is injected by the toy job (data.oom_*: one rank raises torch.OutOfMemoryError for batches over a size,
from a chosen loss computation on), so every test knows which rank runs out, when, and where (forward, or the backward
that holds DDP's gradient all-reduce). The trajectory must not notice: weights are compared in float64 with a run that
never ran out of memory, and with one at the small size."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_same_float64_weights, read_metrics, run_cli
from helpers import assert_params_close
from launcher.rundir import complete_steps
from launcher.train.memory_trial import out_of_memory_in
from launcher.train.micro_batch import MICRO_BATCH_FILE, OUT_OF_MEMORY_EXIT_CODE, halved, sizes_to_try
from launcher.train.sharded_micro_batch import first_to_try

pytestmark = pytest.mark.slow
STEPS = 12
COMMON = ("+exp=toy", "model.dtype=float64", "data.dtype=float64", f"train.max_steps={STEPS}", "train.log_every=1",
          "train.eval_every=0", "train.ckpt_every=4", "train.log_samples=true", "train.global_batch_size=32",
          "scheduler=cosine", "scheduler.warmup_steps=3")  # an lr that changes every step: no extra scheduler step
AUTO = ("train.micro_batch_size=auto", "train.max_micro_batch_size=8")  # 16 samples per rank: 8 fits at first
RANK1_HOLDS_4 = ("data.oom_rank=1", "data.oom_max_items=4")
# Rank 1's loss computations with gradients: 1 probe trial, then 2 micro-batches a step: the 10th is step 5's first
RANK1_HOLDS_4_FROM_STEP_5 = (*RANK1_HOLDS_4, "data.oom_from_call=10")


def launch(run_dir: Path, *overrides: str, expect: int = 0) -> str:
    out = run_cli(*COMMON, *overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / str(step) / "model.safetensors")


def per_step(run_dir: Path, key: str) -> list:
    """`key` of every logged train step (eval records left out)."""
    return [m[key] for m in read_metrics(run_dir) if "eval" not in m and key in m]


def samples(run_dir: Path) -> list[tuple[int, list[int]]]:
    return [(r["step"], r["sample_ids"]) for r in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Runs that never run out of memory, at micro-batch 8 and at micro-batch 4."""
    runs = {size: tmp_path_factory.mktemp("fixed") / str(size) for size in (8, 4)}
    for size, run_dir in runs.items():
        launch(run_dir, f"train.micro_batch_size={size}")
    return runs


def test_sizes_tried_are_divisors_of_the_rank_share() -> None:
    assert sizes_to_try(24, 8) == [8, 6, 4, 3, 2, 1]
    assert sizes_to_try(16, 100) == [16, 8, 4, 2, 1]
    assert (halved(16, 8), halved(24, 6), halved(12, 3), halved(16, 1)) == (4, 3, 1, None)


def test_fsdp_s_first_size_to_try_is_on_the_line_through_two_small_trials() -> None:
    """On a GPU, strategy=fsdp's probe starts at the largest size whose extrapolated peak, plus what only training
    holds (moments, and the unsharded gradients kept between accumulated micro-batches), fits."""
    sizes, peaks = [12, 6, 4, 3, 2, 1], {1: 1000, 2: 1200}  # 200 bytes a sample over a fixed 800
    accumulating = lambda size: 300 if 12 // size > 1 else 0  # noqa: E731
    assert first_to_try(sizes, peaks, lambda size: 0, usable=3200) == 12  # 800 + 12 x 200
    assert first_to_try(sizes, peaks, lambda size: 0, usable=3199) == 6
    assert first_to_try(sizes, peaks, accumulating, usable=3200) == 12  # one micro-batch a step holds no extra
    assert first_to_try(sizes, peaks, lambda size: 0, usable=2200) == 6
    assert first_to_try(sizes, peaks, accumulating, usable=2200) == 4  # 6: 2000 + 300 held between micro-batches
    assert first_to_try(sizes, {1: 1000, 2: 900}, lambda size: 0, usable=1000) == 12  # a peak that does not grow
    assert first_to_try(sizes, peaks, lambda size: 0, usable=500) == 1  # none: the smallest, whose trial says so


def test_running_out_while_torch_compile_compiles_or_in_a_cuda_library_is_running_out() -> None:
    """inductor's autotuning (train.compile_mode=max-autotune) runs kernels while it compiles, and dynamo raises
    what runs out there inside its own error: the step, the probe and the worker's exit take it as running out (it
    once ended the run as a failed compile). A real torch.compile, whose backend runs out here as autotuning would.
    So is a CUDA library's handle that cannot be made (the first backward's cuBLAS one, at the first trial's peak)."""
    def runs_out(graph, inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def fails(graph, inputs):
        raise RuntimeError("a backend's own failure")

    raised = {}
    for backend in (runs_out, fails):
        torch._dynamo.reset()
        with pytest.raises(Exception) as error:
            torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)(torch.ones(4))
        raised[backend] = error.value
    assert not isinstance(raised[runs_out], torch.OutOfMemoryError)  # what an except of it alone missed
    assert str(out_of_memory_in(raised[runs_out])) == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert out_of_memory_in(raised[fails]) is None
    for chained in (None, True):  # the launcher's own error raised while running out was handled is that error
        try:  # (the probe's line for one sample; every rank's copy of a checkpoint writer's error, from it)
            try:
                raise torch.OutOfMemoryError("out")
            except torch.OutOfMemoryError as out:
                raise RuntimeError("the launcher's own line") from (out if chained else None)
        except RuntimeError as other:
            assert out_of_memory_in(other) is None
    for said in ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",  # (outside the
                 "CUDA error: out of memory\nCUDA kernel errors", "Triton Error [CUDA]: out of memory"):  # allocator)
        assert isinstance(out_of_memory_in(RuntimeError(said)), torch.OutOfMemoryError), said
    for other in ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED", "rank 1: CUBLAS_STATUS_ALLOC_FAILED"):  # not running out
        assert out_of_memory_in(RuntimeError(other)) is None


def test_probe_takes_the_largest_size_that_fits_on_every_rank(tmp_path: Path, fixed) -> None:
    """Rank 0 can hold 8, rank 1 only 4: both train with 4 (accumulation 4), and say why."""
    run_dir = tmp_path / "probe"
    log = launch(run_dir, *AUTO, "data.oom_rank=1", "data.oom_max_items=4")
    assert "micro-batch 4, accumulation 4 (train.micro_batch_size=auto: tried rank 0: 8 fits; rank 1: 8 out of " \
           "memory, 4 fits" in log
    assert set(per_step(run_dir, "micro_batch_size")) == {4} and set(per_step(run_dir, "grad_accum_steps")) == {4}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["micro_batch_size"], summary["grad_accum_steps"]) == (4, 4)
    assert json.loads((run_dir / MICRO_BATCH_FILE).read_text())["micro_batch_size"] == 4
    assert_same_float64_weights(run_dir, fixed[4], STEPS)


def test_running_out_mid_run_redoes_the_step_on_every_rank(tmp_path: Path, fixed) -> None:
    """Rank 1 runs out at step 5 (forward of its first micro-batch): every rank drops step 5 and redoes it
    with micro-batch 4; no sample is lost or seen twice, no optimizer or scheduler step is taken twice, and
    the weights equal both the never-out-of-memory run at 8 and the run at 4 (float64, rtol 1e-10)."""
    run_dir = tmp_path / "mid-run"
    log = launch(run_dir, *AUTO, *RANK1_HOLDS_4_FROM_STEP_5)
    assert "rank 1 (CPU memory) ran out of memory at step 5 with micro-batch 8; every rank redoes step 5" in log
    assert per_step(run_dir, "micro_batch_size") == [8] * 4 + [4] * (STEPS - 4)
    assert per_step(run_dir, "grad_accum_steps") == [2] * 4 + [4] * (STEPS - 4)
    assert per_step(run_dir, "step") == list(range(1, STEPS + 1))
    assert samples(run_dir) == samples(fixed[8])
    assert per_step(run_dir, "lr") == per_step(fixed[8], "lr")
    assert per_step(run_dir, "skipped_steps")[-1] == 0
    assert_same_float64_weights(run_dir, fixed[8], STEPS)
    assert_same_float64_weights(run_dir, fixed[4], STEPS)

    # A resume keeps the halved size, from the checkpoint alone (without the run dir's record; the same settings)
    (run_dir / MICRO_BATCH_FILE).unlink()
    log = launch(run_dir, *AUTO, *RANK1_HOLDS_4_FROM_STEP_5, f"train.max_steps={STEPS + 4}", "resume.allow_config_change=true")
    assert f"resumed from step {STEPS}" in log and "micro-batch 4, accumulation 4 (train.micro_batch_size=auto: " \
                                                   "kept from the checkpoint)" in log
    assert per_step(run_dir, "micro_batch_size")[STEPS:] == [4] * 4


def test_running_out_in_the_copy_to_the_device_redoes_the_step_too(tmp_path: Path, fixed) -> None:
    """Rank 1 runs out in the copy before step 2's forward, where DDP rebuilds its buckets (a broadcast it missed,
    waiting in the agreement, until dist.timeout_s): every rank redoes step 2, the 4th loss computation."""
    run_dir = tmp_path / "copy"
    log = launch(run_dir, *AUTO, *RANK1_HOLDS_4, "data.oom_from_call=4", "data.oom_in_copy=true", "dist.timeout_s=60")
    assert "rank 1 (CPU memory) ran out of memory at step 2 with micro-batch 8; every rank redoes step 2" in log
    assert per_step(run_dir, "micro_batch_size") == [8] + [4] * (STEPS - 1)
    assert samples(run_dir) == samples(fixed[8])
    assert_same_float64_weights(run_dir, fixed[8], STEPS)


def test_fp16_dropped_step_leaves_no_trace(tmp_path: Path) -> None:
    """fp16 (float32 weights): the dropped attempt of step 5 takes no optimizer, scheduler or scaler step and
    leaves no gradient behind. The run equals, bitwise, one that switches to micro-batch 4 at step 5 without
    running out of memory (a resume from step 4 with train.micro_batch_size=4; not the run at 8 throughout:
    whether fp16 gradients overflow depends on how many samples a backward holds)."""
    fp16 = ("model.dtype=float32", "data.dtype=float32", "precision=fp16", "precision.init_scale=1048576",
            "precision.growth_interval=3", "train.keep_checkpoints=3")
    switched, run_dir = tmp_path / "switched", tmp_path / "fp16"
    launch(switched, "train.micro_batch_size=8", *fp16, f"train.max_steps={STEPS}")
    for step in (8, 12):
        shutil.rmtree(switched / "checkpoints" / str(step))
    launch(switched, "train.micro_batch_size=4", *fp16)  # resumes from step 4 (micro-batch is not trajectory)
    launch(run_dir, *AUTO, *RANK1_HOLDS_4_FROM_STEP_5, *fp16)
    assert per_step(run_dir, "micro_batch_size") == per_step(switched, "micro_batch_size") == [8] * 4 + [4] * 8
    assert per_step(run_dir, "skipped_steps")[-1] > 0  # the scaler had overflows to handle
    for key in ("loss_scale", "skipped_steps", "lr", "loss", "grad_norm"):
        assert per_step(run_dir, key) == per_step(switched, key), key
    assert all(torch.equal(weights(run_dir)[k], v) for k, v in weights(switched).items())


@pytest.mark.parametrize("max_size, message", [
    ("8", "rank 1 ran out of memory at step 5 even for one sample (CPU memory)"),  # 8 -> 4: its 1-sample backward
    ("1", "rank 1 (CPU memory) ran out of memory at step 5 even with micro-batch 1"),  # nothing below 1
], ids=["while-dropping-the-step", "at-micro-batch-1"])
def test_out_of_memory_even_for_one_sample_ends_the_run_in_one_line(tmp_path: Path, max_size: str, message: str) -> None:
    """Rank 1 can hold nothing from step 5 on: the run fails with one line naming the rank and its memory,
    exit code 1 (not 76: half the size would not help), and the checkpoint of step 4 is kept complete."""
    run_dir = tmp_path / "nothing-fits"
    from_call = 10 if max_size == "8" else 1 + 4 * 16 + 1  # the first loss computation of step 5
    out = run_cli(*COMMON, "train.micro_batch_size=auto", f"train.max_micro_batch_size={max_size}",
                  "data.oom_rank=1", "data.oom_max_items=0", f"data.oom_from_call={from_call}",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and message in error[0], error
    assert complete_steps(run_dir) == [4] and weights(run_dir, 4)


def test_a_fixed_micro_batch_that_runs_out_ends_the_run_suggesting_auto(tmp_path: Path) -> None:
    run_dir = tmp_path / "fixed"
    out = run_cli(*COMMON, "train.micro_batch_size=8", "data.oom_rank=1", "data.oom_max_items=4",
                  "data.oom_from_call=9", f"hydra.run.dir={run_dir}", cwd=tmp_path)  # step 5: no probe call first
    assert out.returncode == 1, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "rank 1 ran out of memory in step 5 (CPU memory; test: more than 4 samples" in error[0] \
        and "with train.micro_batch_size=8; set train.micro_batch_size=auto" in error[0], error
    assert not (run_dir / MICRO_BATCH_FILE).exists()


UNACCUMULATED = ("train.global_batch_size=16",)  # 8 per rank: micro-batch 8 means accumulation 1


@pytest.fixture(scope="module")
def unaccumulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run at micro-batch 8 without accumulation that never runs out of memory."""
    reference = tmp_path_factory.mktemp("unaccumulated") / "reference"
    launch(reference, "train.micro_batch_size=8", *UNACCUMULATED)
    return reference


@pytest.mark.parametrize("restarts", [0, 1], ids=["relaunch", "torchrun-restart"])
def test_out_of_memory_inside_the_all_reduce_exits_and_the_next_start_halves(tmp_path: Path, unaccumulated: Path,
                                                                             restarts: int) -> None:
    """Rank 1 runs out in the backward of the micro-batch that syncs (no accumulation: every backward holds
    the all-reduce), at step 9: the step cannot be redone in-process. The workers exit with
    OUT_OF_MEMORY_EXIT_CODE and one line, then a relaunch (or torchrun's restart, launcher.max_restarts=1)
    resumes from step 8 with micro-batch 4, and the run ends equal to one that never ran out of memory."""
    run_dir, reference = tmp_path / "in-collective", unaccumulated
    # loss computations on rank 1: 1 probe trial, then one per step: the 10th is step 9
    oom = ("train.micro_batch_size=auto", *UNACCUMULATED, "data.oom_rank=1", "data.oom_max_items=4",
           "data.oom_from_call=10", "data.oom_in_backward=true", f"launcher.max_restarts={restarts}")
    log = launch(run_dir, *oom, expect=0 if restarts else OUT_OF_MEMORY_EXIT_CODE)
    where = "rank 1 ran out of memory in or after the gradient all-reduce of step 9"
    record = json.loads((run_dir / MICRO_BATCH_FILE).read_text())
    assert (record["micro_batch_size"], record["why"]) == (4, f"{where} with micro-batch 8, where a step cannot be redone")
    if not restarts:
        error = [line for line in log.splitlines() if line.startswith("error: rank 1 failed")]
        assert len(error) == 1 and where in error[0] and "the next start resumes from the last checkpoint with " \
            f"micro-batch 4: relaunch with hydra.run.dir={run_dir}" in error[0], log[-3000:]
        log = launch(run_dir, *oom)  # the same command again: the relaunch
    assert "resumed from step 8" in log and f"kept from {MICRO_BATCH_FILE}: {where}" in log
    assert per_step(run_dir, "micro_batch_size") == [8] * 8 + [4] * (STEPS - 8)
    assert samples(run_dir) == samples(reference)
    assert_same_float64_weights(run_dir, reference, STEPS)


def test_under_fsdp_running_out_exits_and_the_next_start_halves(tmp_path: Path, fixed) -> None:
    """strategy=fsdp redoes no trial and no step in-process: FSDP2's forward and backward gather weights from
    every rank, and a rank that stopped in one would leave the others in the gather. So running out of memory
    anywhere exits with OUT_OF_MEMORY_EXIT_CODE, and the next start halves.
    In the probe: rank 1 cannot hold 8, so the trial every rank runs at 8 ends the run; the same command again
    trains at 4. Mid-run: rank 1 runs out at step 5, torchrun restarts (launcher.max_restarts=1), and the run
    resumes from step 4 at 4. Both end as DDP's runs that never ran out (float64, rtol 1e-9)."""
    fsdp = ("strategy=fsdp", *AUTO)
    in_probe, cannot = tmp_path / "probe", "with micro-batch 8, which strategy=fsdp cannot redo"
    oom = (*fsdp, "data.oom_rank=1", "data.oom_max_items=4")
    log = launch(in_probe, *oom, expect=OUT_OF_MEMORY_EXIT_CODE)
    error = [line for line in log.splitlines() if line.startswith("error: rank 1 failed")]
    assert len(error) == 1 and "rank 1 ran out of memory in the micro-batch probe (CPU memory; test: more than 4 " \
        f"samples (jobs/toy.py)) {cannot}" in error[0] and "the next start resumes from the last checkpoint with " \
        f"micro-batch 4: relaunch with hydra.run.dir={in_probe}" in error[0], log[-3000:]
    log = launch(in_probe, *oom)  # the same command again
    assert "micro-batch 4, accumulation 4 (train.micro_batch_size=auto: kept from micro_batch.json: rank 1 ran out " \
           f"of memory in the micro-batch probe {cannot}" in log
    assert per_step(in_probe, "micro_batch_size") == [4] * STEPS
    assert_params_close(weights(in_probe), weights(fixed[4]), rtol=1e-9)

    mid_run = tmp_path / "mid-run"
    log = launch(mid_run, *fsdp, *RANK1_HOLDS_4_FROM_STEP_5, "launcher.max_restarts=1")
    assert "micro-batch 8, accumulation 2 (train.micro_batch_size=auto: tried 8 fits on every rank" in log
    assert "resumed from step 4" in log and f"kept from {MICRO_BATCH_FILE}: rank 1 ran out of memory in step 5 " \
                                            f"{cannot}" in log
    assert per_step(mid_run, "micro_batch_size") == [8] * 4 + [4] * (STEPS - 4)
    assert samples(mid_run) == samples(fixed[8])
    assert_params_close(weights(mid_run), weights(fixed[8]), rtol=1e-9)


def test_out_of_memory_in_eval_exits_and_the_relaunch_evaluates_in_halves(tmp_path: Path, fixed) -> None:
    """Rank 1 cannot evaluate batches of 8 (training fits): the eval after step 8 runs out, which no redo
    covers (the other rank waits in eval's all-reduce). Exit OUT_OF_MEMORY_EXIT_CODE with one line; the
    relaunch resumes from step 4 (step 8's checkpoint comes after its eval) at micro-batch 4, evaluates in
    batches of 4, and ends equal to the run that never ran out."""
    run_dir = tmp_path / "in-eval"
    oom = (*AUTO, "train.eval_every=8", "data.oom_rank=1", "data.oom_max_items=4", "data.oom_from_call=1000000",
           "data.oom_in_eval=true")
    log = launch(run_dir, *oom, expect=OUT_OF_MEMORY_EXIT_CODE)
    where = "rank 1 ran out of memory in eval after step 8"
    error = [line for line in log.splitlines() if line.startswith("error: rank 1 failed")]
    assert len(error) == 1 and where in error[0] and "in eval" in error[0], log[-3000:]
    assert json.loads((run_dir / MICRO_BATCH_FILE).read_text())["micro_batch_size"] == 4
    log = launch(run_dir, *oom)
    assert "resumed from step 4" in log
    assert per_step(run_dir, "micro_batch_size") == [8] * 4 + [4] * (STEPS - 4)
    assert [m["step"] for m in read_metrics(run_dir) if "eval" in m] == [8, STEPS]
    assert_same_float64_weights(run_dir, fixed[8], STEPS)
