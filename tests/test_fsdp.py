"""strategy=fsdp (FSDP2) against strategy=ddp, with real processes: torchrun + gloo on CPU (issue 40).

The same math (AdamW, clipping, accumulation, a short last window whose micro-batches differ in number between
the ranks, an uneven eval), half the state per rank, checkpoints whose moments each rank writes in shards and
that resume across strategies and world sizes, preemption and kill -9 resumed bitwise, and a BERT checkpoint plain transformers loads.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import compose_config, read_metrics, run_cli, run_torchrun
from helpers import (DROPOUT, SLOW, assert_params_close, assert_resumes_at_10_as_it_went_on, bitwise_equal, finish,
                     preempt, sample_stream, start, summary, trained, wait_until, weights, worker_pid)
from launcher.compat import FSDP2_ON_CPU
from launcher.derived import ConfigError
from launcher.launch.plan import make_plan

pytestmark = pytest.mark.slow

# float64, AdamW, clipping that clips, 6 micro-batches of 2: 51 samples make every 3rd step a window of 3, which
# rank 0 splits into 2 micro-batches and rank 1 into 1; 25 eval samples make 7 eval batches on rank 0, 6 on rank 1
MATH = ("+exp=toy", "model.dtype=float64", "data.dtype=float64", "data.n_samples=51", "data.n_eval=25",
        "train.global_batch_size=24", "train.micro_batch_size=2", "train.max_grad_norm=0.05", "train.max_steps=20",
        "train.ckpt_every=10", "train.log_every=1", "train.eval_every=0")


def train(run_dir: Path, *overrides: str) -> Path:
    return trained(run_dir, *MATH, *overrides)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same run on 2 ranks with either strategy, checkpointed at steps 10 and 20."""
    root = tmp_path_factory.mktemp("pair")
    return {name: train(root / name, f"strategy={name}") for name in ("ddp", "fsdp")}


def test_fsdp_trains_as_ddp_does_and_keeps_half_the_state(pair: dict[str, Path]) -> None:
    ddp, fsdp = pair["ddp"], pair["fsdp"]
    grad_norms = [m["grad_norm"] for m in map(json.loads, (ddp / "metrics.jsonl").read_text().splitlines())
                  if "grad_norm" in m]
    assert min(grad_norms) > 0.05  # every step clipped
    assert_params_close(weights(fsdp, 20), weights(ddp, 20), rtol=1e-9)
    assert summary(fsdp)["eval"]["loss"] == pytest.approx(summary(ddp)["eval"]["loss"], rel=1e-9)
    assert summary(fsdp)["strategy"] == "fsdp" and summary(ddp)["strategy"] == "ddp"
    sharded, whole = summary(fsdp)["state_bytes_per_rank"], summary(ddp)["state_bytes_per_rank"]
    assert set(sharded) == {"params", "grads", "optimizer"} and whole["optimizer"] > 0
    assert sum(sharded.values()) <= 0.55 * sum(whole.values()), (sharded, whole)
    step_dir = fsdp / "checkpoints" / "20"  # each rank wrote its shards of the moments; rank 0 the rest
    marker = json.loads((step_dir / "COMPLETE").read_text())["sha256"]
    assert {"optimizer/__0_0.distcp", "optimizer/__1_0.distcp", "optimizer/.metadata"} <= set(marker)
    kept = torch.load(step_dir / "train_state.pt", weights_only=True)
    assert kept["optimizer_moments"] == "optimizer" and kept["optimizer"]["state"]
    assert all(value.dim() == 0 for moments in kept["optimizer"]["state"].values() for value in moments.values())
    log = (fsdp / "launcher.log").read_text()
    assert "strategy=fsdp: sharded 2 x Linear (each Linear), then the root" in log
    # a rank slowed on purpose read 1.00x under fsdp, and was named as often as the other: no straggler metrics
    assert "; no straggler metrics (every rank waits for the others in each block's gathers)" in log
    assert not any("slowest_rank" in m for m in read_metrics(fsdp))
    assert "strategy fsdp: each block" in log.splitlines()[0]  # the launcher's first line says the rule


@pytest.mark.parametrize("origin,target", [("fsdp", ("strategy=ddp", "launcher.nproc_per_node=1")),
                                           ("ddp", ("strategy=fsdp", "launcher.nproc_per_node=3")),
                                           ("fsdp", ("strategy=fsdp", "launcher.nproc_per_node=3",
                                                     "train.ckpt_async=false"))],
                         ids=["fsdp-on-1-ddp-rank", "ddp-on-3-fsdp-ranks", "fsdp-on-3-fsdp-ranks"])
def test_a_checkpoint_resumes_on_another_strategy_or_world(tmp_path: Path, pair: dict[str, Path],
                                                          origin: str, target: tuple[str, ...]) -> None:
    """Step 10's checkpoint of one strategy, resumed on another world size by the other strategy or by fsdp (the
    2 ranks' shards of the moments read as 3 ranks' rows; the toy's 2-row output layer leaves rank 2 an empty
    shard, which its own save, written in the foreground, writes too), trains to what the uninterrupted run
    reached at step 20."""
    assert_resumes_at_10_as_it_went_on(pair[origin], tmp_path / "resumed", *MATH, *target)


def test_a_damaged_shard_of_the_moments_makes_its_checkpoint_unusable(tmp_path: Path, pair: dict[str, Path]) -> None:
    """One flipped byte in rank 1's shard of step 20's moments: its sha256 (taken by rank 1, kept in rank 0's
    COMPLETE marker) no longer matches, so the resume says so, takes step 10 and trains to step 20 again."""
    run_dir = tmp_path / "damaged"
    shutil.copytree(pair["fsdp"], run_dir)
    shard = run_dir / "checkpoints" / "20" / "optimizer" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (run_dir / "summary.json").unlink()
    train(run_dir, "strategy=fsdp")
    assert summary(run_dir)["resumed_from"] == 10
    assert "optimizer/__1_0.distcp does not match its checksum" in (run_dir / "launcher.log").read_text()
    assert_params_close(weights(run_dir, 20), weights(pair["fsdp"], 20), rtol=1e-9)


def test_preemption_and_kill_9_under_fsdp_resume_bitwise(tmp_path: Path, reference) -> None:
    """USR2 to the launcher, then the same command, in which a SIGKILL of rank 1 makes torchrun restart the group:
    one run dir through both resumes ends bitwise equal to an uninterrupted fsdp run, dropout's random streams and
    the samples included."""
    run_dir, fsdp = tmp_path / "interrupted", ("strategy=fsdp", *DROPOUT)
    step = preempt(run_dir, signal.SIGUSR2, *fsdp)  # (a checkpoint at a step of 25..45)
    proc = start(run_dir, *SLOW, *fsdp, "launcher.max_restarts=1")
    wait_until(lambda: (run_dir / "checkpoints" / "80" / "COMPLETE").exists())
    time.sleep(random.uniform(0.0, 0.3))
    os.kill(worker_pid(proc.pid, rank=1), signal.SIGKILL)
    out = finish(proc, 0)
    assert f"resumed from step {step}" in out and f"resumed from step {summary(run_dir)['resumed_from']}" in out
    assert summary(run_dir)["restarts"] == 1 and summary(run_dir)["resumed_from"] >= 80
    assert bitwise_equal(weights(run_dir), weights(reference["fsdp"]))
    assert sample_stream(run_dir) == sample_stream(reference["fsdp"])


def test_fp16_skips_and_rescales_under_fsdp_as_under_ddp_and_bf16_trains(tmp_path: Path) -> None:
    """A loss scale far too large: the first steps overflow on some shards; every rank skips them together and
    halves the scale alike, then it grows again every 5 steps, exactly as DDP's does (FSDP2 gathers the weights in
    fp16 and reduces the gradients in float32). bf16 (FSDP2's bf16 gathers, under autocast) trains as DDP does, with
    SGD and momentum (torch's sharded tensors have no rule for fused SGD's kernel, which DDP runs take) and a
    BatchNorm, whose weights FSDP2 would gather in bf16 beside its float32 running statistics (an error)."""
    common = ("+exp=toy", "precision.init_scale=1e8", "precision.growth_interval=5", "train.max_steps=40",
              "train.log_every=5", "train.eval_every=0")
    logs = {}
    sgd = ("optimizer=sgd", "optimizer.momentum=0.9", "model.batch_norm=true")
    for name, precision, optimizer in (("ddp", "fp16", ()), ("fsdp", "fp16", ()), ("ddp", "bf16", sgd),
                                       ("fsdp", "bf16", sgd)):
        run_dir = tmp_path / f"{name}-{precision}"
        out = run_cli(*common, *optimizer, f"strategy={name}", f"precision={precision}", f"hydra.run.dir={run_dir}",
                      cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        logs[name, precision] = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                                 if "loss" in m]
    ddp, fsdp = logs["ddp", "fp16"], logs["fsdp", "fp16"]
    assert [(m["skipped_steps"], m["loss_scale"]) for m in fsdp] == [(m["skipped_steps"], m["loss_scale"]) for m in ddp]
    assert 5 <= fsdp[-1]["skipped_steps"] < 40 and fsdp[-1]["loss_scale"] > fsdp[1]["loss_scale"]
    assert [m["loss"] for m in fsdp] == pytest.approx([m["loss"] for m in ddp], rel=1e-2)
    bf16 = logs["fsdp", "bf16"]
    assert bf16[-1]["loss"] < 0.9 * bf16[0]["loss"] and bf16[-1]["skipped_steps"] == 0
    assert [m["loss"] for m in bf16] == pytest.approx([m["loss"] for m in logs["ddp", "bf16"]], rel=1e-2)


def test_bert_under_fsdp_learns_as_under_ddp_and_its_checkpoints_load_in_transformers(tmp_path: Path,
                                                                                       tiny_bert: Path) -> None:
    """The classifier's eval matches DDP's, compiled block by block too; each checkpoint is a save_pretrained dir
    whose weights are the full ones; the MLM's decoder stays tied to the word embeddings (a tied weight stays
    with the root's shards). The toy's blocks, torch's Linear, cannot compile: refused in one line."""
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

    common = (f"model.pretrained={tiny_bert}", "model.dtype=float64", "model.dropout=0", "data.n_train=48",
              "data.n_eval=23", "train.global_batch_size=8", "train.micro_batch_size=2", "train.max_steps=6")
    runs = {}
    for name in ("ddp", "fsdp"):
        out = run_cli("+exp=bert", *common, f"strategy={name}", f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        runs[name] = summary(tmp_path / name)
    assert runs["fsdp"]["eval"]["accuracy"] == runs["ddp"]["eval"]["accuracy"]
    assert runs["fsdp"]["eval"]["loss"] == pytest.approx(runs["ddp"]["eval"]["loss"], rel=1e-9)
    assert_params_close(weights(tmp_path / "fsdp", 6), weights(tmp_path / "ddp", 6), rtol=1e-9)
    # train.compile=true compiles each BertLayer before sharding it: once, without a break, in the eval neither
    out = run_cli("+exp=bert", *common, "strategy=fsdp", "train.compile=true", "train.log_every=2", "train.eval_every=2",
                  "data.pad_to_multiple_of=${data.max_length}",  # one shape: no recompile for a batch's length
                  f"hydra.run.dir={tmp_path / 'compiled'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    warned = [line for line in (out.stdout + out.stderr).splitlines()  # (+exp=bert's 10 warmup steps are past
              if "warning" in line and "scheduler.warmup_steps" not in line]  # these 6: a warning of the launch's)
    assert "compiled, each block" in out.stdout and not warned, warned
    logged = [m for m in read_metrics(tmp_path / "compiled") if "loss" in m]
    assert [(m["compiled_graphs"], m["graph_breaks"]) for m in logged] == [(logged[0]["compiled_graphs"], 0)] * 3
    assert logged[0]["compiled_graphs"] >= 1
    # (the key biases' gradients are 0 in exact math, softmax being blind to them: Adam turns their rounding
    # noise, which differs between inductor's kernels and eager ones, into steps of lr's size)
    compiled, eager = ({k: v for k, v in weights(tmp_path / run, 6).items() if not k.endswith("key.bias")}
                       for run in ("compiled", "fsdp"))
    assert_params_close(compiled, eager, rtol=1e-7)
    out = run_cli("+exp=toy", "strategy=fsdp", "train.compile=true", f"hydra.run.dir={tmp_path / 'toy'}", cwd=tmp_path)
    assert out.returncode == 1 and "Linear is torch's own module, which torch.compile leaves eager; name a block " \
        "class of the model with strategy.block=<class name>" in out.stderr, out.stderr[-3000:]
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "fsdp" / "checkpoints" / "6")
    assert bitwise_equal({k: v for k, v in loaded.state_dict().items() if k in weights(tmp_path / "fsdp", 6)},
                         weights(tmp_path / "fsdp", 6))
    # in bf16, saved in the background every step: the writer thread describes the float64 weights it wrote, though
    # the module it reads the config of holds bfloat16 copies of them for most of each step
    out = run_cli("+exp=bert_mlm", *common, "strategy=fsdp", "precision=bf16", "train.ckpt_every=1",
                  "train.keep_checkpoints=6", f"hydra.run.dir={tmp_path / 'mlm'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    configs = [json.loads((tmp_path / "mlm" / "checkpoints" / str(step) / "config.json").read_text())
               for step in range(1, 7)]
    assert [config.get("dtype", config.get("torch_dtype")) for config in configs] == ["float64"] * 6  # (transformers 4)
    mlm = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm" / "checkpoints" / "6")
    assert mlm.cls.predictions.decoder.weight is mlm.bert.embeddings.word_embeddings.weight
    saved = load_file(tmp_path / "mlm" / "checkpoints" / "6" / "model.safetensors")
    assert torch.equal(mlm.bert.embeddings.word_embeddings.weight, saved["bert.embeddings.word_embeddings.weight"])


def test_fsdp_on_this_torch_trains_or_is_refused_in_one_line(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """torch 2.7+ trains fsdp on CPU ranks (the pair's fsdp run, which train() checked ended well); the floor, 2.6
    (CI's floor run), is refused before any worker starts."""
    if FSDP2_ON_CPU:
        assert summary(request.getfixturevalue("pair")["fsdp"])["strategy"] == "fsdp"
    else:
        out = run_cli("+exp=toy", "strategy=fsdp", "train.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}",
                      cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            f"error: strategy=fsdp on CPU workers needs torch 2.7 or newer (FSDP2 records events on the CPU's stream, "
            f"pytorch#145935), and this is torch {torch.__version__}: upgrade torch, or use strategy=ddp"]


@pytest.mark.parametrize("overrides,message", [
    (("strategy=fsdp", "train.compile=true", "train.compile_ddp_split=false"), "is DDP's graph split"),
    (("strategy=fsdp", "train.compile=true", "train.global_batch_size=32", "train.micro_batch_size=16",
      "train.compile_mode=reduce-overhead"), "captures CUDA graphs, which FSDP2's gathers between the blocks break"),
    (("strategy=fsdp", "dist.comm_hook=fp16"), "dist.comm_hook=fp16 is DDP's and has no effect with strategy=fsdp"),
    (("strategy.block=BertLayer",), "strategy.block=BertLayer has no effect with strategy=ddp unless "
                                    "train.compile_scope=block compiles the blocks"),
    (("strategy=fsdp", "train.compile=true", "train.compile_scope=model"), "strategy=fsdp compiles each block"),
    (("strategy=fsdp", "optimizer=sgd", "+optimizer.fused=true"), "have no rule for fused SGD's kernel"),
], ids=["ddp-split", "cuda-graphs", "comm-hook", "ddp-block", "whole-model", "fused-sgd"])
def test_what_fsdp_cannot_do_is_refused_in_the_parent(overrides: tuple[str, ...], message: str) -> None:
    cfg = compose_config("+exp=toy", *overrides)
    with pytest.raises(ConfigError, match=message):
        make_plan(cfg)


GATHERS = '''
import json
import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from launcher.train import dist, sharding
from launcher.train.precision import Precision

dist.init("cpu", "gloo", 60)  # as the worker does
gathered = []
all_gather = _fsdp_param_group.foreach_all_gather
_fsdp_param_group.foreach_all_gather = lambda *a, **k: gathered.append(1) or all_gather(*a, **k)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 3), nn.LayerNorm(3))
model[1].requires_grad_(False)  # a frozen BatchNorm (fine-tuning) is gathered in its own dtype too
said = sharding.shard(model, True, None, Precision("bf16", "cpu"), torch.device("cpu"), 2, 2)
with torch.autocast("cpu", torch.bfloat16):
    loss = model(torch.randn(6, 4)).float().sum()
forward = len(gathered)
loss.backward()
if torch.distributed.get_rank() == 0:  # both ranks' lines could run into one
    print(json.dumps({"said": said, "forward": forward, "total": len(gathered)}))
del model, loss
dist.shutdown()  # as the worker ends: a process group left to the interpreter's exit may abort it
'''


def test_fsdp_gathers_each_group_once_a_forward_and_the_blocks_again_in_the_backward(tmp_path: Path) -> None:
    """strategy.reshard_after_forward=true: each block (3 x Linear) and the (frozen) BatchNorm's group of its own
    dtype reshard after the forward and are gathered again in the backward; the root (the Sequential: its
    LayerNorm's weights) keeps what it gathered: 4 groups and the root, 5 gathers forward, 9 in all (10 when the root
    was given reshard_after_forward=true as the blocks are: it gathered its weights again at once)."""
    if not FSDP2_ON_CPU:
        pytest.skip("FSDP2 on CPU ranks needs torch 2.7 (test_fsdp_on_this_torch_trains_or_is_refused_in_one_line)")
    script = tmp_path / "gathers.py"
    script.write_text(GATHERS)
    out = run_torchrun(2, script)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["said"] == "3 x Linear (each Linear), then the root; 1 x BatchNorm gathered in its own dtype"
    assert (result["forward"], result["total"]) == (5, 9), result
