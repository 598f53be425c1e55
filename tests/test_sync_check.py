"""train.sync_check (issue 11): a steady step of the launcher never makes the host wait for the GPU, and
what would is named in one line. Real 2-rank gloo runs: on the CPU the check watches torch's dispatcher for
what syncs on a GPU (tests/test_gpu.py runs it on CUDA, with torch's own sync debug mode too)."""
from __future__ import annotations

import json
import subprocess
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import run_cli
from launcher.train.sync_check import SyncCheck, host_side, unpinned_copy_target

# steps 1-3 warm up; 6 and 12 log: 4, 5, 7, 8, 9, 10 and 11 are checked
STEPS = ("train.max_steps=12", "train.log_every=6")
CHECKED = 7


def checked_run(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, subprocess.CompletedProcess]:
    run_dir = tmp_path / name
    out = run_cli(*STEPS, *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("+exp=toy", "precision=fp16"),  # GradScaler; the fused optimizer skips on the device
    ("+exp=toy", "precision=fp16", "optimizer=sgd"),  # SGD without momentum: no state, fused from step 1
    # Rank 1 runs out of memory in step 5's first micro-batch (its 18th loss: 1 probe, 4 per step): every rank
    # drops the step and redoes it in micro-batches of 2, under the check, where step 5 is checked once
    ("+exp=toy", "precision=bf16", "train.micro_batch_size=auto", "train.max_micro_batch_size=4",
     "data.oom_rank=1", "data.oom_max_items=2", "data.oom_from_call=18"),
    ("+exp=bert", "data.n_train=256", "data.n_eval=32"),  # padded batches: the attention mask
    # and each layer run again in the backward (torch's checkpoint saves and restores the random state for it)
    ("+exp=bert", "data.n_train=256", "data.n_eval=32", "model.activation_checkpointing=true"),
], ids=["toy-fp16", "toy-fp16-sgd", "toy-bf16-auto-oom", "bert", "bert-checkpointed"])
def test_a_steady_step_would_not_wait_for_a_gpu(tmp_path: Path, request: pytest.FixtureRequest,
                                                overrides: tuple[str, ...]) -> None:
    if overrides[0] == "+exp=bert":  # a small BERT with the real tokenizer
        overrides = (*overrides, f"model.pretrained={request.getfixturevalue('tiny_bert')}")
    summary, out = checked_run(tmp_path, "run", *overrides, "train.sync_check=error")
    assert (summary["host_syncs"], summary["checked_steps"]) == (0, CHECKED)
    assert "wait for a GPU" not in out.stderr
    if "data.oom_rank=1" in overrides:
        assert "ran out of memory at step 5 with micro-batch 4; every rank redoes step 5" in out.stdout + out.stderr
        assert summary["micro_batch_size"] == 2


@pytest.mark.slow
def test_a_read_in_the_forward_is_named_once_and_counted(tmp_path: Path) -> None:
    """The toy's host_read model calls .item() in its forward: warn names the line once, counts every read
    (2 micro-batches per step on each of 2 ranks), and the run goes on; error stops at the first."""
    summary, out = checked_run(tmp_path, "warn", "+exp=toy", "model.host_read=true", "train.sync_check=warn")
    named = [line for line in out.stderr.splitlines() if "would wait for a GPU" in line]
    assert len(named) == 1 and named[0].startswith("warning: step 4 would wait for a GPU: "), named
    assert "/jobs/toy.py:" in named[0]
    assert "(forward) reads a device value on the host" in named[0]
    assert (summary["host_syncs"], summary["checked_steps"], summary["steps"]) == (CHECKED * 2 * 2, CHECKED, 12)

    out = run_cli("+exp=toy", *STEPS, "model.host_read=true", "train.sync_check=error",
                  f"hydra.run.dir={tmp_path / 'error'}", cwd=tmp_path)
    assert out.returncode != 0
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: rank ") and "step 4 would wait for a GPU: " in error, error
    assert "/jobs/toy.py:" in error
    assert "(train.sync_check=error)" in error and "train.sync_check=warn" in error


def test_what_the_check_finds_on_the_cpu() -> None:
    """Reads of a value, shapes that depend on the data and copies to the host are found; device-side work,
    a fused optimizer skipping on found_inf and the launcher's own host_side reads are not."""
    check = SyncCheck("warn", torch.device("cpu"))
    x, param = torch.randn(8), torch.nn.Parameter(torch.randn(8))
    optimizer = torch.optim.AdamW([param], fused=True)
    reported: list[str] = []
    with check.watching(7, reported.append):
        param.grad = x.clone()
        optimizer.grad_scale, optimizer.found_inf = None, torch.isfinite(x.sum()).logical_not().float()
        optimizer.step()
        y = torch.where(x > 0, x, 0.0).sum() * 2 + x.masked_fill(x < 0, 0).mean()
        x.repeat_interleave(torch.tensor([2] * 8), output_size=16)
        with host_side():
            y.tolist()
    assert (check.syncs, reported) == (0, [])
    reads = {"item": lambda: y.item(), "bool": lambda: bool(y > 0), "mask": lambda: x[x > 0],
             "nonzero": lambda: torch.nonzero(x), "unique": lambda: torch.unique(x), "cpu": lambda: y.cpu(),
             "tolist": lambda: x.tolist(), "masked_set": lambda: x.clone().__setitem__(x > 0, 0.0),
             "repeat": lambda: x.repeat_interleave(torch.tensor([2] * 8))}
    for name, read in reads.items():
        with check.watching(8, reported.append):
            read()
        assert check.syncs == list(reads).index(name) + 1, name
    # each place once: the reads above sit on four lines of this file
    assert len(reported) == len(check.found) == 4 and all("test_sync_check.py:" in line for line in reported)
    # steps 7 and 8: step 8 watched again and again, as a step redone after running out of memory, is one step
    assert check.read() == {"host_syncs": len(reads), "checked_steps": 2}


def test_a_non_blocking_copy_from_unpinned_memory_is_told_from_what_the_dispatcher_passes() -> None:
    """What a CUDA run's check flags (tests/test_gpu.py copies to a GPU): the ops as torch's dispatcher hands
    them over, here copies to the meta device. Blocking copies are torch's own check's; pinned memory (a
    GPU build only) is the launcher's way."""
    class Targets(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
            targets.append(unpinned_copy_target(func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    x, on_meta, targets = torch.ones(8), torch.empty(8, device="meta"), []
    with Targets():
        x.to("meta", non_blocking=True)
        on_meta.copy_(x, non_blocking=True)
        x.to("meta")
        on_meta.copy_(x)
        x.to(torch.float64, non_blocking=True)  # stays on the host
        torch.ones(0).to("meta", non_blocking=True)  # nothing to copy (an MLM batch with no masked token)
        (x * 2).sum()
    assert targets == ["meta", "meta", None, None, None, None, None, None, None], targets


def test_torch_s_own_cuda_warnings_are_placed_and_counted_and_others_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, torch's sync debug mode warns from inside an op: the warning is counted and placed at the line
    that ran the op, and any other warning still reaches the user. The warning comes from Python here (this
    CPU build of torch cannot switch CUDA's mode: tests/test_gpu.py does it on a GPU)."""
    from launcher.train import sync_check

    monkeypatch.setattr(sync_check, "_cuda_debug_mode", lambda mode: nullcontext())
    check, reported = SyncCheck("warn", torch.device("cpu")), []
    check.cuda = True  # the CUDA run's watch: torch's warnings are listened to
    with pytest.warns(UserWarning, match="something else"):
        with check.watching(9, reported.append):
            warnings.warn(f"called a {sync_check.SYNC_WARNING}")
            warnings.warn("something else")
    assert check.syncs == 1 and len(reported) == 1, reported
    assert reported[0].startswith("warning: step 9 waits for the GPU: tests/test_sync_check.py:"), reported
    assert "synchronizes with the GPU" in reported[0]
