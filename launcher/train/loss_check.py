"""Whether the job's loss_sum and eval_sums sum: a loss that is a mean trains on a gradient that depends on the
split, and eval sums that are means report metrics that depend on the eval's batches and ranks.

The step divides the summed loss by the items of the whole step on all ranks (launcher/train/step.py); a loss_sum
that is already a mean (HF's `outputs.loss`, `reduction="mean"`) is divided twice: its learning rate shrinks with
the micro-batch and its gradient changes with the world size and accumulation, with nothing said. Tried before the
first step on the first two train samples: their loss together against each one's alone, added up, about half of
it for a mean. A warning, not an error: what a job's loss may be cannot all be foreseen (a sum plus a term per batch
that outweighs it on a fresh model looks like a mean too). The eval's sums alike, on the first two eval samples.
Exercised by: tests/test_own_job.py.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from launcher.task import to_device
from launcher.train.data import random_streams_kept, seed_worker_for
from launcher.train.evaluation import eval_mode

if TYPE_CHECKING:
    from launcher.train.run import Run

# A fresh model's loss is about the same for each item: a mean of two (items, or tokens of two samples) is about
# half the two alone, added up; a sum is about equal to it (padding and autocast move it by far less). Only that
# signature is told: a collate that augments at random, or samples that meet, move the ratio elsewhere.
MEAN_OF_TWO = (0.3, 0.7)


@torch.no_grad()
def probe_loss_sum(run: Run, target: str) -> None:
    """Warn (rank 0) when loss_sum of train samples 0 and 1 together is about half each one's alone. Every rank
    runs the same three forwards (strategy=fsdp's gather weights in each); the random streams are left as they were,
    and each collate starts from the same state (a job's collate may draw)."""
    task, device = run.task, run.env.device
    if len(task.train_set) < 2:
        return

    def loss_of(indices: list[int]) -> float:
        with random_streams_kept(device):  # (a dataset may draw as it reads, a collate as it batches)
            batch = task.collate([task.train_set[i] for i in indices])
            return float(task.loss_sum(run.model, to_device(batch, device)))  # the model the step hands it

    try:  # in eval mode, a sample's loss does not depend on its batch (no dropout, BatchNorm's running statistics)
        with eval_mode(run), run.precision.autocast():
            together, alone = loss_of([0, 1]), [loss_of([0]), loss_of([1])]
    except Exception:  # noqa: BLE001 - a loss that takes no batch of one, or is no number: the step tells its own
        return         # error (every rank reads the same samples, so all return here alike)
    if looks_like_a_mean(together, sum(alone)):
        run.log.warn(f"warning: data._target_={target}: its loss_sum gave {together:.4g} for train samples 0 and 1 "
                     f"together and {sum(alone):.4g} for each alone, added up: a mean? Return the sum over the batch's "
                     f"items (reduction='sum'): the launcher divides by count_items over the step on all ranks")
    if task.eval_set is not None and len(task.eval_set) >= 2:
        _probe_eval_sums(run, target)


def looks_like_a_mean(together: float, apart: float) -> bool:
    return math.isfinite(together) and math.isfinite(apart) and bool(apart) and \
        MEAN_OF_TWO[0] <= together / apart <= MEAN_OF_TWO[1]


def _probe_eval_sums(run: Run, target: str) -> None:
    """Warn (rank 0) for each eval sum of eval samples 0 and 1 together that is about half each one's alone (a
    per-batch mean: its metric would change with the eval's batches and ranks). Every rank alike: each draws from
    the same seeds. Not where the two samples' sums change with the seed (a collate that masks at random, as HF's
    DataCollatorForLanguageModeling): sample 1 alone would draw sample 0's masks, and a count not add up."""
    task, device = run.task, run.env.device

    def sums_of(indices: list[int], seed: int = 0) -> dict[str, float]:
        with random_streams_kept(device):
            seed_worker_for(seed)  # (torch's, Python's and numpy's streams)
            batch = to_device(task.collate([task.eval_set[i] for i in indices]), device)
            sums = task.eval_sums(run.module, batch)  # the model evaluate() hands it
            return {key: float(sums[key]) for key in task.eval_sum_keys}

    def probe() -> tuple[dict[str, float], dict[str, float], dict[str, float]] | None:
        together, again = sums_of([0, 1]), sums_of([0, 1], seed=1)
        if any(not math.isclose(together[key], again[key], rel_tol=1e-5) for key in task.eval_sum_keys):
            return None  # drawn at random: the comparison below would say nothing
        return together, sums_of([0]), sums_of([1])

    # At the weights' own precision, not autocast's: a count of argmax hits (accuracy's) flips between a batch of two
    # and one alone where bf16 rounds a near tie apart, as a fresh head's logits are. Autocast's where the model
    # takes no input at its weights' precision (model.dtype=bfloat16 and float32 data), as the eval runs it
    for precision in (nullcontext, run.precision.autocast):
        try:
            with eval_mode(run), precision():
                probed = probe()
            break
        except Exception:  # noqa: BLE001 - probe_eval told what it could; the eval tells the rest
            probed = None
    if probed is None:
        return
    together, first, second = probed
    means = [key for key in task.eval_sum_keys if looks_like_a_mean(together[key], first[key] + second[key])]
    if means:
        run.log.warn(f"warning: data._target_={target}: its eval_sums' {', '.join(map(repr, means))} for eval samples "
                     f"0 and 1 together is about half the two alone, added up: a mean? Return sums over the batch's "
                     f"items: the launcher adds them up over batches and ranks, and eval_metrics divides")
