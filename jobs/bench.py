"""The benchmark workload: a BERT built from a config (random weights) on random token sequences.

Shared by `+exp=bench` and the hand-written loop in bench/raw_ddp.py, so both train the same model on
the same data. Exercised by: `python bench/compare.py`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from jobs.activation_checkpointing import checkpoint_activations
from jobs.attention import use_sdpa_unmasked


def bert_from_config(layers: int = 4, hidden: int = 256, heads: int = 4, vocab_size: int = 30522,
                     max_length: int = 128, num_labels: int = 2, activation_checkpointing: bool = False,
                     dropout: float = 0.1) -> torch.nn.Module:
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=4 * hidden,
                        max_position_embeddings=max_length, num_labels=num_labels,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = use_sdpa_unmasked(BertForSequenceClassification(config))  # no mask built when compiled (jobs/attention.py)
    return checkpoint_activations(model, activation_checkpointing)


class RandomTokens:
    """Fixed-length random token ids with random labels: the data costs nothing, the model everything."""

    eval_sum_keys = ("loss_sum", "count")

    def __init__(self, n_samples: int = 4096, seq_len: int = 128, vocab_size: int = 30522, num_labels: int = 2,
                 seed: int = 0, n_eval: int = 0):
        generator = torch.Generator().manual_seed(seed)
        ids = [torch.randint(1000, vocab_size, (n_samples, seq_len), generator=generator)]
        labels = [torch.randint(0, num_labels, (n_samples,), generator=generator)]
        if n_eval:  # drawn after the train set's, which stays the same with or without an eval set
            ids.append(torch.randint(1000, vocab_size, (n_eval, seq_len), generator=generator))
            labels.append(torch.randint(0, num_labels, (n_eval,), generator=generator))
        self.input_ids, self.labels = torch.cat(ids), torch.cat(labels)
        self.train_set = list(range(n_samples))
        self.eval_set = list(range(n_samples, n_samples + n_eval)) or None

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        ids = self.input_ids[indices]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[indices]}

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(len(batch["labels"]))

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # No padding, so no attention mask for the model (the batch keeps it for tokens/s): with one, HF's
        # SDPA attention checks `mask.all()` on the GPU, a host sync in every forward (jobs/attention.py).
        logits = model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss_sum": self.loss_sum(model, batch), "count": self.count_items(batch)}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss_sum"] / max(sums["count"], 1)}
