"""strategy=fsdp strategy.shard_size (hybrid sharding, HSDP) with real processes: 4 gloo ranks on CPU as 2 replicas
of 2 shards train as DDP does, keep half its state, write checkpoints that resume on plain fsdp, and load DDP's;
with strategy.reduce_every_micro_batch the all-reduce across the replicas still waits for a step's last
micro-batch.
"""
from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from conftest import compose_config
from helpers import (assert_params_close, assert_resumes_at_10_as_it_went_on, probe, profiled_ops, summary, trained,
                     weights)
from launcher.compat import FSDP2_ON_CPU
from launcher.derived import ConfigError
from launcher.launch.plan import make_plan

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 on CPU ranks needs torch 2.7 "
                                                   "(test_fsdp_on_this_torch_trains_or_is_refused_in_one_line)")]

# float64, AdamW, clipping, 4 ranks x 3 micro-batches of 2 a step; checkpoints at 10 (in the background) and 20
MATH = ("+exp=toy", "model.dtype=float64", "data.dtype=float64", "data.n_samples=51", "data.n_eval=25",
        "train.global_batch_size=24", "train.micro_batch_size=2", "train.max_grad_norm=0.05", "train.max_steps=20",
        "train.ckpt_every=10", "train.log_every=1", "train.eval_every=0", "launcher.nproc_per_node=4")
HYBRID = ("strategy=fsdp", "strategy.shard_size=2")


def train(run_dir: Path, *overrides: str) -> Path:
    return trained(run_dir, *MATH, *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {"ddp": train(root / "ddp", "strategy=ddp"), "hybrid": train(root / "hybrid", *HYBRID)}


def test_hybrid_sharding_trains_as_ddp_does_and_keeps_half_the_state(runs: dict[str, Path]) -> None:
    assert_params_close(weights(runs["hybrid"], 20), weights(runs["ddp"], 20), rtol=1e-9)
    assert summary(runs["hybrid"])["eval"]["loss"] == pytest.approx(summary(runs["ddp"])["eval"]["loss"], rel=1e-9)
    sharded, whole = summary(runs["hybrid"])["state_bytes_per_rank"], summary(runs["ddp"])["state_bytes_per_rank"]
    assert 0.45 * sum(whole.values()) <= sum(sharded.values()) <= 0.55 * sum(whole.values()), (sharded, whole)
    assert "then the root; over 2 ranks, 2 replicas (hybrid)" in (runs["hybrid"] / "launcher.log").read_text()
    for step in (10, 20):  # the background save's host copies and the final one: each row of the moments once
        shards = runs["hybrid"] / "checkpoints" / str(step) / "optimizer"
        metadata = dcp.FileSystemReader(shards).read_metadata()
        moments = [key for key in metadata.state_dict_metadata if key.startswith("state/")]
        assert len(metadata.storage_data) == 2 * len(moments)  # 2 shards each, not 4 as over all ranks
        # every byte of the files is one of those chunks: a row two replicas hold is written once
        assert sum(p.stat().st_size for p in shards.glob("*.distcp")) == sum(
            info.length for info in metadata.storage_data.values())


@pytest.mark.parametrize("origin,target", [("hybrid", ("strategy=fsdp", "launcher.nproc_per_node=2")),
                                           ("ddp", (*HYBRID, "train.ckpt_async=false"))],
                         ids=["hybrid-on-2-fsdp-ranks", "ddp-on-hybrid"])
def test_a_checkpoint_resumes_across_hybrid_sharding(tmp_path: Path, runs: dict[str, Path], origin: str,
                                                     target: tuple[str, ...]) -> None:
    """Step 10's checkpoint, resumed by plain fsdp on 2 ranks (its replicas' rows read as 2 ranks' shards) or, from
    DDP's full moments, by hybrid sharding (each rank keeps its rows of them), trains to the uninterrupted run's
    step 20."""
    assert_resumes_at_10_as_it_went_on(runs[origin], tmp_path / "resumed", *MATH, *target)


def collectives(run_dir: Path) -> collections.Counter:
    """The reduce-scatters and all-reduces in rank 0's profiled step (torch's op names)."""
    return collections.Counter(name for name in profiled_ops(run_dir)
                               if name in ("c10d::_reduce_scatter_base_", "c10d::allreduce_"))


def test_reducing_every_micro_batch_all_reduces_across_the_replicas_once_a_step(tmp_path: Path,
                                                                                runs: dict[str, Path]) -> None:
    """Each of the step's 3 micro-batches reduce-scatters the 2 blocks' gradients within the replica, and the
    all-reduces across the replicas stay as many as when the step reduces once (2 blocks', and the step's and its
    log line's 3)."""
    profiled = ("train.profile=[7,7]", "train.max_steps=10", "train.ckpt_every=0")
    once = train(tmp_path / "once", *HYBRID, *profiled)
    each = train(tmp_path / "each", *HYBRID, *profiled, "strategy.reduce_every_micro_batch=true")
    assert collectives(once) == {"c10d::_reduce_scatter_base_": 2, "c10d::allreduce_": 5}, collectives(once)
    assert collectives(each) == {"c10d::_reduce_scatter_base_": 6, "c10d::allreduce_": 5}, collectives(each)
    assert_params_close(weights(each, 10), weights(once, 10), rtol=1e-9)


@pytest.mark.parametrize("overrides,message", [
    (("strategy=fsdp", "strategy.shard_size=3"), "strategy.shard_size=3 must be null (all 4 ranks), node, or a "
                                                 "number of ranks that divides the world size 4"),
    (("strategy=fsdp", "strategy.shard_size=nodes"), "strategy.shard_size='nodes' must be null"),
    (("strategy=fsdp", "strategy.shard_size=6", "launcher.nnodes=3", "launcher.rdzv_endpoint=127.0.0.1:29400",
      "hydra.run.dir=/tmp/shared", "train.global_batch_size=96"),
     "strategy.shard_size=6 splits nodes of 4 workers across groups; use a divisor or a multiple of 4 (node: 4)"),
    (("strategy.shard_size=node",), "strategy.shard_size=node has no effect with strategy=ddp; add strategy=fsdp"),
], ids=["not-a-divisor", "not-a-size", "straddling-nodes", "ddp"])
def test_a_shard_size_that_cannot_be_is_refused_in_the_parent(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan(compose_config("+exp=toy", "launcher.nproc_per_node=4", *overrides))


def test_the_mesh_s_own_groups_keep_the_run_s_timeouts(tmp_path: Path) -> None:
    """torch makes hybrid sharding's replica and shard groups with its default timeout (NCCL's 10 minutes; gloo's 30
    here): they take the main group's, dist.startup_timeout_s until the first step and dist.timeout_s after."""
    records = probe(tmp_path, 4, "timeouts", *HYBRID, "dist.startup_timeout_s=900", "dist.timeout_s=120")
    for record in records:
        assert record == {"startup": {"main": 900, "replicate": 900, "shard": 900},
                          "training": {"main": 120, "replicate": 120, "shard": 120}}, record
