"""strategy.meta_init (launcher/train/meta_init.py), with real processes: torchrun + gloo on CPU.

Under strategy=fsdp only rank 0 builds the model whole; the others build it on the meta device, keep their rows
of each tensor rank 0 broadcasts, and copy them into their shards once the model is sharded. A probe model records
where each rank built it, and has what a broadcast could miss: a weight tied to another, a frozen one, one of a
single row (none for the other ranks), a buffer no state_dict holds (non-persistent), a persistent one, one
buffer of two modules, a tensor in a plain attribute (of two modules), and a plain attribute that is a buffer. Its
training is bitwise the one of every rank building whole, on 2 ranks and on 3 (uneven rows). A build that
differs between the ranks or fails on the meta device is refused in one line naming strategy.meta_init=false.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import REPO, compose_config, read_metrics, run_cli
from helpers import bitwise_equal, weights
from launcher.derived import ConfigError
from launcher.launch.plan import make_plan

pytestmark = pytest.mark.slow

PROBE = textwrap.dedent('''\
    """A probe model for tests/test_meta_init.py: the MLP's keys, and ways to build badly on the meta device."""
    import os
    from pathlib import Path

    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, in_features, hidden, out_features, depth=2, dtype="float32", host_read=False, dropout=0.0,
                     batch_norm=False, untraceable=False, differs=False, fails=False, lost=False):
            super().__init__()
            on_meta = torch.get_default_device().type == "meta"
            Path(os.environ["PROBE_DIR"], "rank" + os.environ["RANK"]).write_text(str(torch.get_default_device()))
            hidden += int(differs and on_meta)
            if fails:
                torch.ones(1).item()  # a host read: meta tensors have no value
            self.inp = nn.Linear(in_features, hidden)
            self.mid, self.again = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
            self.again.weight = self.mid.weight  # tied
            self.out = nn.Linear(hidden, out_features)
            self.frozen = nn.Parameter(torch.randn(hidden), requires_grad=False)
            self.gain = nn.Parameter(torch.tensor([1.5]))  # one row: none for the ranks after rank 0
            self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden), persistent=False)
            self.register_buffer("shift", torch.randn(hidden) / 10)
            self.table = self.out.table = torch.arange(hidden) / hidden  # neither a parameter nor a buffer
            self.to(getattr(torch, dtype))  # (a tensor of two modules becomes two: .to() converts each module's)
            tilt = torch.linspace(-0.2, 0.2, hidden, dtype=getattr(torch, dtype))  # one buffer of two modules
            self.inp.register_buffer("tilt", tilt, persistent=False)
            self.mid.register_buffer("tilt", tilt, persistent=False)
            self.scale_again = self.scale  # a plain attribute that is a buffer (transformers 4's rotary embeddings)
            if lost:
                self.lost = torch.empty(3, device="meta")  # (as transformers 5's from_pretrained may leave one)

        def forward(self, x):
            h = torch.tanh(self.inp(x) + self.inp.tilt) * self.scale + self.shift + self.frozen + self.table
            h = torch.tanh(self.mid(h) + self.mid.tilt) * self.scale_again
            return self.out(torch.tanh(self.again(h))) * self.gain + self.out.table[1]
    ''')

COMMON = ("+exp=toy", "model._target_=meta_probe.Net", "model.dtype=float64", "data.dtype=float64", "strategy=fsdp",
          "train.global_batch_size=12", "train.micro_batch_size=2", "train.max_steps=6", "train.log_every=1",
          "train.eval_every=3", "train.ckpt_every=6")


def launch(tmp_path: Path, name: str, *overrides: str):
    """The probe trained into tmp_path/name; each rank's build device in tmp_path/name-built."""
    (tmp_path / "meta_probe.py").write_text(PROBE)
    built = tmp_path / f"{name}-built"
    built.mkdir()
    out = run_cli(*COMMON, *overrides, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path,
                  PYTHONPATH=f"{tmp_path}:{REPO}", PROBE_DIR=str(built))
    return out, {path.name: path.read_text() for path in sorted(built.iterdir())}


RUNS = ("meta", "whole")


@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_0_alone_builds_and_the_run_trains_bitwise_as_when_every_rank_builds(tmp_path: Path, ranks: int) -> None:
    plan = f"launcher.nproc_per_node={ranks}"
    out, built = launch(tmp_path, "meta", plan)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert built == {"rank0": "cpu", **{f"rank{r}": "meta" for r in range(1, ranks)}}
    assert "built on rank 0 alone" in out.stdout
    out, built = launch(tmp_path, "whole", plan, "strategy.meta_init=false")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert built == {f"rank{r}": "cpu" for r in range(ranks)} and "built on rank 0 alone" not in out.stdout
    logged = [[(m["step"], m.get("loss"), m.get("eval")) for m in read_metrics(tmp_path / run)] for run in RUNS]
    assert logged[0] == logged[1] and len(logged[0]) == 8
    assert bitwise_equal(weights(tmp_path / "meta", 6), weights(tmp_path / "whole", 6))


@pytest.mark.parametrize(("bad", "said"), [
    ("+model.differs=true", "strategy=fsdp: rank 1 built on the meta device a model unlike rank 0's (frozen [33] "
                            "float64 requires_grad=False against rank 0's frozen [32] float64 requires_grad=False); "
                            "the job's build must make the same structure there, or set strategy.meta_init=false"),
    ("+model.lost=true", "strategy=fsdp: rank 0's model keeps lost on the meta device, outside its parameters and "
                         "buffers: no rank can send it; make it a buffer (register_buffer), or set "
                         "strategy.meta_init=false"),
    ("+model.fails=true", "model._target_=meta_probe.Net failed: RuntimeError: Tensor.item() cannot be called on meta "
                          "tensors (strategy=fsdp: ranks other than 0 build the model on the meta device; a job's "
                          "build makes the structure alone where torch.get_default_device() is meta, e.g. "
                          "transformers' from_config; or set strategy.meta_init=false"),
])
def test_a_build_the_meta_device_cannot_make_is_refused_in_one_line(tmp_path: Path, bad: str, said: str) -> None:
    out, _ = launch(tmp_path, "bad", "launcher.nproc_per_node=2", "train.max_steps=1", bad)
    assert out.returncode == 1 and said in out.stderr, out.stdout[-2000:] + out.stderr[-4000:]
    out, built = launch(tmp_path, "whole", "launcher.nproc_per_node=2", "train.max_steps=1", bad,
                        "strategy.meta_init=false")  # where every rank builds whole, each of these trains
    assert out.returncode == 0 and built == {"rank0": "cpu", "rank1": "cpu"}, out.stdout[-2000:] + out.stderr[-4000:]


def test_meta_init_under_ddp_is_refused_in_the_parent() -> None:
    """DDP builds the model on every rank (its constructor broadcasts rank 0's weights): the key would do nothing."""
    with pytest.raises(ConfigError, match=r"strategy.meta_init=false has no effect with strategy=ddp; add "
                                          r"strategy=fsdp, or drop strategy.meta_init"):
        make_plan(compose_config("+exp=toy", "strategy.meta_init=false"))
