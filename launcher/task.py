"""The small public interface a job in `jobs/` implements; the launcher knows jobs only through it.

`conf/data/*.yaml` names the job's builder with `_target_`; `conf/model/*.yaml` names its model.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class Task(Protocol):
    """Data and loss of one training task.

    Losses are SUMS over items (samples, or MLM loss tokens); the launcher divides by the number of
    items in the whole optimizer step, counted on every rank, so the gradient does not depend on how
    the step is split into micro-batches and ranks.
    """

    train_set: Sequence[Any]
    eval_set: Sequence[Any] | None
    eval_sum_keys: tuple[str, ...]  # the sums eval_sums returns; every rank reduces the same keys

    def collate(self, samples: list[Any]) -> dict[str, torch.Tensor]: ...

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """How many items loss_sum sums over in this batch (a 0-dim tensor). Called on the CPU batch, in
        the data loader, so the step never asks the GPU for it."""

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sum of per-item losses of this batch."""

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums (loss, correct, counts...) that add up exactly across batches and ranks."""

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the global sums, e.g. accuracy = correct / count: a function of the sums alone (the
        worker learns the metrics' names for train.best_metric from sums that are all 1)."""

    # Optional: def largest_batch(self, size: int) -> dict[str, torch.Tensor]
    #   `size` training samples as large as a batch of this job gets (the longest sequences, for text):
    #   train.micro_batch_size=auto probes memory with it. Without it, the first `size` samples are used
    #   (right for jobs whose samples all have one size).
    # Optional: def write_model_files(self, model: torch.nn.Module, directory: Path) -> None
    #   What makes checkpoints/<step>/ loadable without the launcher, written beside its model.safetensors
    #   (a transformers job: config.json and the tokenizer; then from_pretrained loads the checkpoint, and
    #   model.pretrained=<run dir> starts another run from the run's newest one). Under train.ckpt_async it runs in
    #   the checkpoint's writer thread while training goes on: it reads only what training never changes (the
    #   model's config), and the weights' dtype from the model.safetensors already written in `directory` (under
    #   strategy=fsdp with bf16/fp16 the module's parameters are half-precision copies in the middle of a step).
    # The model's target under strategy=fsdp (strategy.meta_init) runs on the meta device on every rank but 0, whose
    # weights the others receive: where torch.get_default_device() is meta, build the structure alone, the same as
    # rank 0's, and read no weights (transformers: from_config, not from_pretrained; jobs/bert.py's _load_model).
    # An error the job raises while it is built, with a true `one_line` attribute, is a message for the user (a
    # bad row of a data file): the launcher shows its one line, and no rank its traceback.


def count_tokens(batch: dict[str, torch.Tensor]) -> int | None:
    """Non-pad tokens of a (CPU) text batch, for tokens/s; None when the batch has no attention mask."""
    mask = batch.get("attention_mask")
    return None if mask is None else int(mask.sum())


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    # non_blocking overlaps the copy with compute when the DataLoader pins memory
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
