"""strategy=fsdp's gradient accumulation, with real processes (torchrun + gloo on CPU): one reduce-scatter a step
(the default: each rank holds its whole gradients between micro-batches), or one every micro-batch
(strategy.reduce_every_micro_batch=true: the gradients stay sharded), the same math either way.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compose_config
from helpers import assert_params_close, profiled_ops, trained, weights
from launcher.compat import FSDP2_ON_CPU
from launcher.derived import ConfigError
from launcher.launch.plan import make_plan

pytestmark = pytest.mark.slow

# float64, AdamW, clipping, 2 ranks x 6 micro-batches of 2 a step; 51 samples make every 3rd step a window of 3,
# which rank 0 splits into 2 micro-batches and rank 1 into 1, repeated with weight 0 (every rank reduce-scatters
# after each); step 7 (a whole window) is profiled
ACCUMULATING = ("+exp=toy", "strategy=fsdp", "model.dtype=float64", "data.dtype=float64", "data.n_samples=51",
                "train.global_batch_size=24", "train.micro_batch_size=2", "train.max_grad_norm=0.05",
                "train.max_steps=10", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0",
                "train.profile=[7,7]")


def reductions(run_dir: Path) -> list[str]:
    """The reduce-scatters FSDP2 ran in rank 0's profiled step, one trace event each (torch names its range
    `FSDP::post_backward_reduce (<the group's module>)`)."""
    return sorted(name for name in profiled_ops(run_dir) if name.startswith("FSDP::post_backward_reduce"))


def test_reducing_every_micro_batch_reduces_six_times_as_often_and_trains_the_same(tmp_path: Path) -> None:
    if not FSDP2_ON_CPU:
        pytest.skip("FSDP2 on CPU ranks needs torch 2.7 (test_fsdp_on_this_torch_trains_or_is_refused_in_one_line)")
    runs = {every: trained(tmp_path / every, *ACCUMULATING, f"strategy.reduce_every_micro_batch={every}")
            for every in ("false", "true")}
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


def test_reducing_every_micro_batch_without_accumulation_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"strategy.reduce_every_micro_batch=true has no effect with one micro-batch "
                                          r"a step \(train.micro_batch_size=16 of train.global_batch_size=32: no "
                                          r"accumulation\); drop it, or lower train.micro_batch_size"):
        make_plan(compose_config("+exp=toy", "strategy=fsdp", "strategy.reduce_every_micro_batch=true",
                                 "train.micro_batch_size=16"))
