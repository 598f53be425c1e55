"""The eval: exact metrics over the whole eval set, each rank summing its disjoint share.

Exercised by: `python -m launcher +exp=toy` (its eval at the end), tests/test_distributed_math.py.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from launcher.task import to_device
from launcher.train import sharding
from launcher.train.data import eval_batches
from launcher.train.dist import all_reduce_sum

if TYPE_CHECKING:
    from launcher.train.run import Run


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Exact metrics: each rank sums over its disjoint share, one all-reduce adds the sums."""
    if run.task.eval_set is None:
        return {}
    module = run.module  # the bare module: DDP's forward could enter collectives unevenly here (FSDP's module
    # enters its all-gathers in every forward: every rank runs as many as rank 0)
    module.eval()
    # Blocks compiled in place (strategy=fsdp, train.compile_scope=block: launcher/train/compiled.py) would compile
    # again for the eval's no_grad forwards, for the eval alone: they run eagerly, as the bare module of a whole
    # compiled model does
    with torch.compiler.set_stance("force_eager") if run.compile_watch.enabled else nullcontext():
        metrics = _sums(run, module)
    module.train()
    return metrics


def _sums(run: Run, module: torch.nn.Module) -> dict[str, float]:
    """The eval's metrics from every rank's sums over its share."""
    keys, device = run.task.eval_sum_keys, run.env.device
    sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
    host_sums = [0.0] * len(keys)  # float64 too
    for batch, counts in eval_batches(run.task, run.env.rank, run.env.world_size, run.micro_batch_size,
                                      pin=device.type == "cuda", same_count=sharding.is_sharded(module)):
        with run.precision.autocast():
            batch_sums = run.task.eval_sums(module, to_device(batch, device))
        if not counts:  # (strategy=fsdp: a forward to join the others' all-gathers)
            continue
        # A job may count on the CPU (len() -> torch.tensor) and sum on the GPU: each adds up where it is, as
        # a copy of a host value to the GPU per batch would make the host wait for the GPU each time.
        for i, value in enumerate(batch_sums[k] for k in keys):
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":  # a copy between GPUs: no wait
                sums[i] += value.to(device, non_blocking=True).reshape(())
            else:
                host_sums[i] += float(value)
    sums += torch.tensor(host_sums, dtype=torch.float64).to(device)
    all_reduce_sum(sums)
    return run.task.eval_metrics(dict(zip(keys, sums.tolist())))
