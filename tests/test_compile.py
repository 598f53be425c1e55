"""torch.compile (issue 11): the launcher's step adds no graph break or recompile to a compiled model, what
does recompile or break is reported with its reason, and the train.compile_* keys reach torch. Real
2-rank gloo runs; tests/test_gpu.py runs the CUDA-graph mode on a GPU."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import read_metrics, run_cli
from helpers import free_port, node

pytestmark = pytest.mark.slow
SMALL_BERT = ("model.layers=1", "model.hidden=64", "model.heads=2", "data.seq_len=32", "data.n_samples=256")


def compiled_run(tmp_path: Path, name: str, *overrides: str, exp: str = "toy") -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path / name
    out = run_cli(f"+exp={exp}", "train.compile=true", *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return run_dir, out


def logged(run_dir: Path) -> list[dict]:
    return [m for m in read_metrics(run_dir) if "loss" in m]


def compile_warnings(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if "warning: torch.compile" in line]


def test_the_step_around_a_compiled_bert_compiles_once_without_graph_breaks(tmp_path: Path) -> None:
    """no_sync, autocast, the loss outside the model, the device-side flags: none of it breaks the graph or
    recompiles it in later steps. One graph per rank for all 8 steps, and nothing to warn about. In bf16, the
    step with the most around the model (fp32 only lacks autocast; test_distributed_math compiles it)."""
    run_dir, out = compiled_run(tmp_path, "bf16", *SMALL_BERT, "precision=bf16", "train.max_steps=8",
                                "train.log_every=2", "train.global_batch_size=16", "train.micro_batch_size=4", exp="bench")
    assert [(m["compiled_graphs"], m["graph_breaks"]) for m in logged(run_dir)] == [(1, 0)] * 4
    assert not compile_warnings(out)


def test_a_shape_change_recompiles_once_and_says_why(tmp_path: Path) -> None:
    """1000 samples in windows of 32: the epoch's last window has 8, micro-batches of 2 instead of 8, and
    dynamo compiles again at step 32. The log after it says so, with dynamo's reason; with
    train.compile_dynamic=true the first graph takes any batch size and nothing recompiles. (5 features: a
    batch dim equal to a weight's dim, 8 and 8, would be specialized by dynamo's duck sizing.)"""
    short_window = ("data.n_samples=1000", "data.in_features=5", "train.max_steps=40", "train.log_every=10")
    run_dir, out = compiled_run(tmp_path, "static", *short_window)
    assert [m["compiled_graphs"] for m in logged(run_dir)] == [1, 1, 1, 2]
    (warning,) = compile_warnings(out)
    assert warning.startswith("step 40: warning: torch.compile compiled 1 more graph(s)") and "size mismatch" in warning
    assert json.loads((run_dir / "summary.json").read_text())["compiled_graphs"] == 2

    run_dir, out = compiled_run(tmp_path, "dynamic", *short_window, "train.compile_dynamic=true")
    assert [m["compiled_graphs"] for m in logged(run_dir)] == [1, 1, 1, 1] and not compile_warnings(out)


def test_a_graph_break_is_reported_and_fullgraph_makes_it_a_one_line_error(tmp_path: Path) -> None:
    """The toy's host_read model reads an activation with .item() mid-forward: dynamo splits the graph."""
    run_dir, out = compiled_run(tmp_path, "breaks", "model.host_read=true", "train.max_steps=20", "train.log_every=10")
    assert all(m["graph_breaks"] >= 1 for m in logged(run_dir))
    (warning,) = compile_warnings(out)  # once, though both ranks and both logs see it
    assert warning.startswith("step 10: warning: torch.compile breaks the model's graph") and "Tensor.item" in warning

    for micro_batch in ("8", "auto"):  # auto: the micro-batch probe's trials compile first
        out = run_cli("+exp=toy", "train.compile=true", "train.compile_fullgraph=true", "model.host_read=true",
                      f"train.micro_batch_size={micro_batch}", "train.max_steps=20",
                      f"hydra.run.dir={tmp_path / f'fullgraph-{micro_batch}'}", cwd=tmp_path)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
        assert "train.compile_fullgraph=true and torch.compile met a graph break at " in errors[0]
        assert "jobs/toy.py:" in errors[0] and "drop train.compile_fullgraph" in errors[0]


def test_one_node_compiles_one_graph_that_trains_like_eager_and_the_split_stays_an_override(tmp_path: Path) -> None:
    """Four 1 MB layers in 1 MB buckets: on one node train.compile=true compiles one graph (compiled_pieces 1;
    DDP's reducer all-reduces the buckets as the one backward ends); train.compile_ddp_split=true cuts it at the
    buckets as dynamo's DDPOptimizer does by default. On 2 ranks all three log eager's losses: the whole graph's
    gradients are still all-reduced (the cut one's are: tests/test_distributed_math.py)."""
    wide = ("model.hidden=512", "model.depth=4", "dist.bucket_cap_mb=1", "train.max_steps=20", "train.log_every=10")
    pieces, losses, said = {}, {}, {}
    for split, mode in (("null", ()), ("true", ("train.compile_mode=default",))):
        run_dir, out = compiled_run(tmp_path, f"split-{split}", *wide, f"train.compile_ddp_split={split}", *mode)
        pieces[split] = [(m["compiled_graphs"], m["compiled_pieces"]) for m in logged(run_dir)]
        losses[split] = [m["loss"] for m in logged(run_dir)]
        said[split] = out.stdout.splitlines()[0]  # the launcher's first line: how it will run
        # (no CUDA-graph mode, named or not: no skips counted, nothing to warn about)
        assert not compile_warnings(out) and all("cudagraph_skips" not in m for m in logged(run_dir))
    assert said["null"].endswith("| compiled, one graph") and said["true"].endswith("| compiled, cut at DDP's buckets")
    assert pieces["null"] == [(1, 1)] * 2
    assert all(graphs == 1 and cuts > 1 for graphs, cuts in pieces["true"]), pieces
    out = run_cli("+exp=toy", *wide, f"hydra.run.dir={tmp_path / 'eager'}", cwd=tmp_path)  # auto: eager on the CPU
    assert out.returncode == 0 and "| eager (auto)" in out.stdout, out.stderr[-3000:]
    eager = [m["loss"] for m in logged(tmp_path / "eager")]
    assert losses["null"] == pytest.approx(eager, rel=1e-5) and losses["true"] == pytest.approx(eager, rel=1e-5)


def test_compile_scope_block_traces_one_layer_for_the_stack_uncut_inside_ddp_and_trains_like_eager(
        tmp_path: Path) -> None:
    """train.compile_scope=block compiles the embeddings and each BertLayer on their own (transformers'
    _no_split_modules): two graphs, the three layers running one (dynamo traced one layer, the layers' weights its
    inputs), neither cut though each layer (3 MB) is larger than DDP's 1 MB buckets (dynamo's DDPOptimizer would cut
    it inside DDP's forward), nor compiled again by the evals (they run the blocks eagerly), and 2 ranks log eager's
    losses and evals: DDP still all-reduces every gradient, accumulation included."""
    # (no dropout: inductor draws its random numbers otherwise than eager does)
    layers = ("model.layers=3", "model.hidden=256", "model.heads=2", "model.dropout=0", "data.seq_len=32",
              "data.n_samples=256", "data.n_eval=16", "dist.bucket_cap_mb=1", "train.max_steps=6", "train.log_every=2",
              "train.eval_every=2", "train.global_batch_size=16", "train.micro_batch_size=4")
    run_dir, out = compiled_run(tmp_path, "block", *layers, "train.compile_scope=block", exp="bench")
    assert out.stdout.splitlines()[0].endswith("| compiled, each block"), out.stdout
    assert "compile_scope=block: compiling 4 x BertEmbeddings/BertLayer (the model's _no_split_modules)" in out.stdout
    assert [(m["compiled_graphs"], m["compiled_pieces"], m["graph_breaks"]) for m in logged(run_dir)] == [(2, 2, 0)] * 3
    assert not compile_warnings(out)
    out = run_cli("+exp=bench", *layers, f"hydra.run.dir={tmp_path / 'eager'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    eager = [m["loss"] for m in logged(tmp_path / "eager")]
    assert [m["loss"] for m in logged(run_dir)] == pytest.approx(eager, rel=1e-5)
    evals = [[m["eval"]["loss"] for m in read_metrics(run) if "eval" in m] for run in (run_dir, tmp_path / "eager")]
    assert len(evals[0]) == 3 and evals[0] == pytest.approx(evals[1], rel=1e-5), evals


def test_a_block_that_dynamo_leaves_eager_is_refused_in_one_line() -> None:
    """The toy's blocks are torch's own Linear: compiling them would compile nothing."""
    import torch

    from launcher.train.compiled import compile_blocks

    with pytest.raises(ValueError, match=r"Linear is torch's own module, which torch.compile leaves eager; name a "
                                         r"block class of the model with strategy.block=<class name>, or drop "
                                         r"train.compile_scope \(the whole model compiles\)"):
        compile_blocks([torch.nn.Linear(2, 2)], train=None, sharded=False)


def test_two_nodes_keep_the_graph_cut_at_ddp_s_buckets(tmp_path: Path) -> None:
    """Across nodes the cuts pay: each bucket's all-reduce overlaps the rest of the backward. Two launchers of one
    worker each, as two nodes: train.compile=true keeps dynamo's split (compiled_pieces > 1)."""
    run_dir, port = tmp_path / "shared", free_port()
    wide = ("train.compile=true", "model.hidden=512", "model.depth=4", "dist.bucket_cap_mb=1")
    nodes = [node(run_dir, port, *wide), node(run_dir, port, *wide)]
    for proc in nodes:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (out + err)[-3000:]
    assert "compiled, cut at DDP's buckets" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compiled"] and summary["compiled_pieces"] > 1, summary


def test_a_cuda_graph_mode_reaches_inductor(tmp_path: Path) -> None:
    """reduce-overhead asks inductor for CUDA graphs; on the CPU it records a skip for every graph, which
    the metrics count and one warning explains (on a GPU the count stays 0: tests/test_gpu.py). The control,
    train.compile_mode=default, counts none: test_one_node_compiles_one_graph_that_trains_like_eager..."""
    one_micro_batch = ("train.micro_batch_size=16", "train.max_steps=10", "train.log_every=5")
    run_dir, out = compiled_run(tmp_path, "cudagraphs", *one_micro_batch, "train.compile_mode=reduce-overhead")
    assert all(m["cudagraph_skips"] >= 1 for m in logged(run_dir))
    assert any("captured no CUDA graph" in line for line in compile_warnings(out))


def test_only_errors_of_compiling_become_one_compile_line() -> None:
    """In-process: a user's error inside a compiled module keeps its own type and message; a failure of
    dynamo itself (a graph break under fullgraph) becomes one line naming the user's line and the cause."""
    import torch

    from launcher.train.compiled import failures_in_one_line

    def wrong_input(x: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"expected 4 features, got {x.shape[-1]}")

    def host_read(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x  # .item(): a graph break

    with pytest.raises(ValueError, match="expected 4 features, got 5"):
        with failures_in_one_line(compiling=True, fullgraph=False):
            torch.compile(wrong_input)(torch.ones(2, 5))
    with pytest.raises(RuntimeError) as raised:
        with failures_in_one_line(compiling=True, fullgraph=True):
            torch.compile(host_read, fullgraph=True)(torch.ones(2, 5))
    line = str(raised.value)
    assert "\n" not in line and line.startswith("train.compile_fullgraph=true and torch.compile met a graph break at "
                                                f"{__file__}:")
    assert "drop train.compile_fullgraph" in line
