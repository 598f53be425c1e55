"""strategy=fsdp's gradient accumulation, with real processes (torchrun + gloo on CPU): one reduce-scatter a step
(the default: each rank holds its whole gradients between micro-batches), or one every micro-batch
(strategy.reduce_every_micro_batch=true: the gradients stay sharded), the same math either way.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import compose_config, run_cli
from helpers import assert_params_close, weights
from launcher.compat import FSDP2_ON_CPU
from launcher.derived import ConfigError
from launcher.launch.plan import make_plan

pytestmark = pytest.mark.slow

# float64, AdamW, clipping, 2 ranks x 6 micro-batches of 2 a step; step 7 is profiled (a steady step, no save)
ACCUMULATING = ("+exp=toy", "strategy=fsdp", "model.dtype=float64", "data.dtype=float64", "data.n_samples=48",
                "train.global_batch_size=24", "train.micro_batch_size=2", "train.max_grad_norm=0.05",
                "train.max_steps=10", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0",
                "train.profile=[7,7]")


def reductions(run_dir: Path) -> list[str]:
    """The reduce-scatters FSDP2 ran in rank 0's profiled step, one trace event each (torch names its range
    `FSDP::post_backward_reduce (<the group's module>)`)."""
    trace = json.loads(next((run_dir / "profile").glob("rank0.*.pt.trace.json")).read_text())
    return sorted(event["name"] for event in trace["traceEvents"]
                  if event.get("ph") == "X" and event["name"].startswith("FSDP::post_backward_reduce"))


def test_reducing_every_micro_batch_reduces_six_times_as_often_and_trains_the_same(tmp_path: Path) -> None:
    if not FSDP2_ON_CPU:
        pytest.skip("FSDP2 on CPU ranks needs torch 2.7 (test_fsdp_on_this_torch_trains_or_is_refused_in_one_line)")
    runs = {}
    for every in ("false", "true"):
        run_dir = tmp_path / every
        out = run_cli(*ACCUMULATING, f"strategy.reduce_every_micro_batch={every}", f"hydra.run.dir={run_dir}",
                      cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        runs[every] = run_dir
    once, each = reductions(runs["false"]), reductions(runs["true"])
    assert len(once) == 2 and len(set(once)) == 2, once  # the toy's 2 Linear blocks, once a step (the root has none)
    assert each == sorted(once * 6), each  # each block after each of the 6 micro-batches' backwards
    assert_params_close(weights(runs["true"], 10), weights(runs["false"], 10), rtol=1e-9)
    assert "each micro-batch's gradients reduce-scattered" in (runs["true"] / "launcher.log").read_text()
    assert "reduce-scattered" not in (runs["false"] / "launcher.log").read_text()


def test_reducing_every_micro_batch_is_fsdps_key() -> None:
    with pytest.raises(ConfigError, match=r"strategy.reduce_every_micro_batch=true has no effect with strategy=ddp; "
                                          r"add strategy=fsdp, or drop strategy.reduce_every_micro_batch"):
        make_plan(compose_config("+exp=toy", "strategy.reduce_every_micro_batch=true"))
