"""The eval: exact metrics over the whole eval set, each rank summing its disjoint share.

Exercised by: `python -m launcher +exp=toy` (its eval at the end), tests/test_distributed_math.py.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator

import torch

from launcher.derived import ConfigError
from launcher.task import to_device
from launcher.train import sharding
from launcher.train.data import eval_batches, random_streams_kept
from launcher.train.dist import all_reduce_sum

if TYPE_CHECKING:
    from launcher.train.run import Run


@torch.no_grad()
def probe_eval(run: Run, target: str) -> None:
    """The job's eval parts on its first two eval samples, before the first step (every rank, one forward each): a
    sum missing from what eval_sums returns, or metrics that are not numbers, failed only at the first eval, and
    with train.eval_every=0 only after the last step: a whole run's time spent before the fault showed. ConfigError
    names the part. The random streams are left as they were (a job's collate may draw from them)."""
    task, job = run.task, f"data._target_={target}"
    with eval_mode(run), random_streams_kept(run.env.device), run.precision.autocast():
        samples = [task.eval_set[i] for i in range(min(2, len(task.eval_set)))]  # (a dataset may draw as it reads)
        sums = task.eval_sums(run.module, to_device(task.collate(samples), run.env.device))
    if not isinstance(sums, Mapping):
        raise ConfigError(f"{job}: its eval_sums returned a {type(sums).__name__}; return a dict of sums named by "
                          f"its eval_sum_keys ({', '.join(task.eval_sum_keys)})")
    missing = [key for key in task.eval_sum_keys if key not in sums]
    if missing:
        raise ConfigError(f"{job}: its eval_sums returned no {', '.join(map(repr, missing))} (its eval_sum_keys: "
                          f"{', '.join(task.eval_sum_keys)}; it returned {', '.join(map(str, sums)) or 'none'})")
    extra = [str(key) for key in sums if key not in task.eval_sum_keys]
    if extra:  # (a job's diagnostics, or a sum it forgot to name)
        run.log.warn(f"warning: {job}: its eval_sums returned {', '.join(extra)}, which its eval_sum_keys do not "
                     f"name: not added up, not reported")
    for key in task.eval_sum_keys:
        if isinstance(sums[key], torch.Tensor) and sums[key].numel() != 1 or not isinstance(sums[key], (
                torch.Tensor, numbers.Real)):
            raise ConfigError(f"{job}: its eval_sums' {key!r} is {_what(sums[key])}; each sum is one number (a "
                              f"tensor of one value, or a Python number) that adds up across batches and ranks")
    metrics, fault = None, None  # sums that are all 1, as Task says (launcher/train/best.py learns the names so),
    for tried in ({key: 1.0 for key in task.eval_sum_keys}, {key: float(sums[key]) for key in task.eval_sum_keys}):
        try:  # then the two samples' own: metrics that need real sums (a count of 1 - 1, sums that must agree)
            metrics, fault = task.eval_metrics(tried), None
            break
        except (ArithmeticError, ValueError):  # (math.log(0) is a ValueError) a division by a sum of 0 there
            fault = None
        except Exception as error:  # noqa: BLE001 - told below if the real sums fail so too
            fault = error
    if fault is not None:  # a KeyError, a name: the first eval would fail so, or the last one
        said = next((line for line in str(fault).splitlines() if line.strip()), "")
        raise ConfigError(f"{job}: its eval_metrics failed on the sums of its first eval samples: "
                          f"{type(fault).__name__}: {said}") from fault
    if metrics is None:  # no sums it could take here: the eval tells
        return
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"{job}: its eval_metrics returned {_what(metrics)}; return a dict of metric names to "
                          f"Python numbers")
    for name, value in metrics.items():
        if not isinstance(value, (int, float)):  # what metrics.jsonl can hold (numpy's float32 not)
            raise ConfigError(f"{job}: its eval_metrics' {name!r} is {_what(value)}; return Python numbers "
                              f"(float(...) of a tensor)")
    run.best.check_among(list(metrics))  # train.best_metric, where all-ones sums gave no names (best.best_eval)


def _what(value: object) -> str:
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
    return f"a {type(value).__name__}{shape}"


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Exact metrics: each rank sums over its disjoint share, one all-reduce adds the sums."""
    if run.task.eval_set is None:
        return {}
    # the bare module: DDP's forward could enter collectives unevenly here (FSDP's module enters its all-gathers in
    # every forward: every rank runs as many as rank 0)
    with eval_mode(run):
        return _sums(run, run.module)


@contextmanager
def eval_mode(run: Run) -> Iterator[None]:
    """The model in eval mode (no dropout, BatchNorm's running statistics), then in train mode again. Blocks compiled
    in place (strategy=fsdp, train.compile_scope=block: launcher/train/compiled.py) would compile again for no_grad
    forwards, for those alone: they run eagerly, as the bare module of a whole compiled model does."""
    run.module.eval()
    try:
        with torch.compiler.set_stance("force_eager") if run.compile_watch.enabled else nullcontext():
            yield
    finally:
        run.module.train()


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
