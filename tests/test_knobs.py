"""Performance knobs take effect (issue 7): what DDP, the optimizer and torch report after a real step."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import read_metrics, run_cli
from helpers import probe

pytestmark = pytest.mark.slow


def knobs(tmp_path: Path, *overrides: str, exp: str = "toy") -> dict:
    ranks = probe(tmp_path, 2, "knobs", "train.max_steps=2", *overrides, exp=exp)
    assert ranks[0]["knobs"] == ranks[1]["knobs"]
    return ranks[0]["knobs"]


def test_defaults(tmp_path: Path) -> None:
    got = knobs(tmp_path / "defaults")
    assert got["gradient_as_bucket_view"] == 1 and got["static_graph"] == 0 and got["find_unused_parameters"] == 0
    assert got["comm_hook"] in (None, "", "builtin_allreduce")  # no compression unless asked
    assert got["fused"] is True  # fused AdamW on every device: the same skip path as on a GPU
    assert got["compiled"] == "Sequential"


SMALL_BERT = ("model.layers=1", "model.hidden=64", "model.heads=2", "data.n_samples=64", "data.seq_len=16",
              "train.global_batch_size=4", "train.micro_batch_size=2")


def test_bucket_cap_sets_ddp_buckets(tmp_path: Path) -> None:
    """The cap reaches DDP and changes its buckets (rebuilt after the first step). A 2-layer BERT, 256
    hidden, has 31 MB of word embeddings (their gradients come last) after 6 MB of layers: a 1 MB cap
    splits the layers into several all-reduces, while the default is torch's own: 25 MB after a 1 MB first
    bucket (2 buckets), so the last layers' all-reduce starts early."""
    bert = ("model.layers=2", "model.hidden=256", "model.heads=4", *SMALL_BERT[3:])
    default = knobs(tmp_path / "default", *bert, exp="bench")
    small = knobs(tmp_path / "small", *bert, "dist.bucket_cap_mb=1", exp="bench")
    assert (default["bucket_cap_bytes"], small["bucket_cap_bytes"]) == (25 * 2**20, 2**20)
    assert default["buckets"] == 2 and small["buckets"] > 2


def test_ddp_and_optimizer_knobs_reach_ddp(tmp_path: Path) -> None:
    got = knobs(tmp_path / "set", *SMALL_BERT, "dist.gradient_as_bucket_view=false", "dist.static_graph=true",
                "dist.comm_hook=fp16", "+optimizer.fused=false", exp="bench")
    assert got["gradient_as_bucket_view"] == 0 and got["static_graph"] == 1
    assert "fp16_compress_hook" in str(got["comm_hook"])
    assert got["fused"] is False  # the config's own choice wins over the fused default


def test_compile_wraps_the_module_ddp_trains(tmp_path: Path) -> None:
    assert knobs(tmp_path / "compiled", "train.compile=true")["compiled"] == "OptimizedModule"


def test_data_loader_workers_keep_the_trajectory(tmp_path: Path) -> None:
    """Windows prepared by 2 loader processes per rank (prefetching) train exactly the same steps."""
    losses = []
    for workers in (0, 2):
        run_dir = tmp_path / f"workers{workers}"
        out = run_cli("+exp=toy", "train.max_steps=20", "train.log_every=1", f"train.num_workers={workers}",
                      "train.prefetch_factor=4", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        losses.append([m["loss"] for m in read_metrics(run_dir) if "loss" in m])
    assert losses[0] == losses[1]
