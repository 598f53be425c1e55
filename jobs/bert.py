"""BERT jobs on HF transformers: sequence classification and masked-LM pre-training.
Exercised by: `python -m launcher +exp=bert` and `python -m launcher +exp=bert_mlm`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers import (AutoConfig, AutoModelForSequenceClassification, BertForMaskedLM,
                          DataCollatorForTokenClassification, DataCollatorWithPadding)

from jobs.activation_checkpointing import checkpoint_activations
from jobs.attention import model_inputs, use_sdpa_unmasked
from jobs.labels import Labels
from jobs.pretrained_files import write_pretrained_files
from jobs.text import (GLUE_FIELDS, DataError, check_text, corpus_lines, load_file_rows, load_hub_rows,
                       sentiment_rows, text_columns, text_file_rows)
from jobs.vocab import fit_embeddings, load_tokenizer

transformers.utils.logging.disable_progress_bar()
if os.environ.get("RANK", "0") != "0":  # one load report is enough
    transformers.logging.set_verbosity_error()


def _load_model(cls: Any, pretrained: str, **kwargs: Any) -> torch.nn.Module:
    """from_pretrained with transformers' load report (a key table, "seems corrupted") as rank 0's one line; on
    the meta device (strategy=fsdp's ranks other than 0, which receive rank 0's weights) the structure alone, from
    the same config, reading no weights."""
    if torch.get_default_device().type == "meta":
        config = kwargs.pop("config", None) or _from_pretrained(AutoConfig, pretrained, **kwargs)
        return cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    verbosity, _ = transformers.logging.get_verbosity(), transformers.logging.set_verbosity_error()
    try:
        model, info = _from_pretrained(cls, pretrained, output_loading_info=True, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    fresh = sorted({*info.get("missing_keys", ()), *(str(m[0]) for m in info.get("mismatched_keys", ()))})
    unused = sorted({key.split(".")[0] for key in info.get("unexpected_keys", ())})
    said = [*([f"initialised fresh: {', '.join(fresh)} (a resume loads them from this run's checkpoint)"] * bool(fresh)),
            *([f"weights of the checkpoint unused: {', '.join(unused)}"] * bool(unused))]
    if said and os.environ.get("RANK", "0") == "0":
        print(f"model.pretrained={pretrained}: {'; '.join(said)}", flush=True)
    return model


def _from_pretrained(cls: Any, pretrained: str, **kwargs: Any) -> Any:
    try:
        return cls.from_pretrained(pretrained, **kwargs)
    except OSError as err:
        raise DataError(f"model.pretrained={pretrained} is not a local model dir and could not be loaded "
                         f"from the hub ({str(err).splitlines()[0][:160]}); offline, give a dir written by "
                         f"save_pretrained") from None


# What model.dropout sets where a config has it: BERT's three, and ALBERT's, DistilBERT's, DeBERTa's names
DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "classifier_dropout_prob",
                "dropout", "attention_dropout", "seq_classif_dropout", "cls_dropout", "pooler_dropout")


def _config(pretrained: str, dropout: float | None, **kwargs: Any) -> dict[str, Any]:
    """from_pretrained's config: model.dropout (checked in the parent) on every dropout probability the
    model's config has; null keeps the checkpoint's (0.1 for BERT)."""
    if dropout is None:
        return kwargs
    config = _from_pretrained(AutoConfig, pretrained, **kwargs)
    keys = [key for key in DROPOUT_KEYS if hasattr(config, key)]
    if not keys:
        raise DataError(f"model.dropout={dropout}: the config of model.pretrained={pretrained} names no dropout "
                         f"probability this job knows ({', '.join(DROPOUT_KEYS)}); set model.dropout=null")
    for key in keys:
        setattr(config, key, dropout)
    return {"config": config}


def classification_model(pretrained: str, num_labels: int, dtype: str = "float32", dropout: float | None = None,
                         activation_checkpointing: bool = False, tokenizer: str | None = None) -> torch.nn.Module:
    """A hub id (bert-base-uncased) or a local dir; the classifier head is new when it has none. `tokenizer`: the
    data's, whose added tokens get embedding rows (jobs/vocab.py)."""
    model = fit_embeddings(_load_model(AutoModelForSequenceClassification, pretrained,
                                       **_config(pretrained, dropout, num_labels=num_labels)), tokenizer)
    return checkpoint_activations(use_sdpa_unmasked(model), activation_checkpointing).to(getattr(torch, dtype))


class BertMaskedLMSum(BertForMaskedLM):
    """BertForMaskedLM whose forward returns the SUM of the loss over masked tokens (and their logits).

    The vocabulary projection runs only at masked positions (on all positions it is most of the cost),
    gathered by `masked_positions`, flat indices the collate step found on the CPU: a boolean mask
    (`hidden[labels != -100]`) would make the GPU tell the host how many there are, a sync per forward.
    """

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, masked_positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state
        if masked_positions is None:  # called without our collate: find them here (a host sync on a GPU)
            masked_positions = _masked_positions(labels)
        logits = self.cls(hidden.flatten(0, 1).index_select(0, masked_positions))
        targets = labels.flatten().index_select(0, masked_positions)
        return F.cross_entropy(_fp32(logits), targets, reduction="sum"), logits


def _masked_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices (into batch x length) of the tokens the MLM loss is taken over."""
    return (labels.flatten() != -100).nonzero().squeeze(1)


def masked_lm_model(pretrained: str, dtype: str = "float32", dropout: float | None = None,
                    activation_checkpointing: bool = False, tokenizer: str | None = None) -> torch.nn.Module:
    """BERT weights from a hub id or local dir; an MLM head is initialised when the dir has none. `tokenizer`: as
    classification_model's."""
    model_type = _from_pretrained(AutoConfig, pretrained).model_type
    if model_type != "bert":  # BertForMaskedLM would load none of its weights and pre-train from random ones
        raise DataError(f"model.pretrained={pretrained} is a {model_type} model; model=bert_mlm pre-trains BERT only "
                         f"(model_type bert, as bert-base-uncased): give a BERT checkpoint")
    model = fit_embeddings(_load_model(BertMaskedLMSum, pretrained, **_config(pretrained, dropout)), tokenizer)
    return checkpoint_activations(use_sdpa_unmasked(model), activation_checkpointing).to(getattr(torch, dtype))


def _fp32(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits go to float32 for the loss; float32/float64 stay as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _mark_padding(batch: Any) -> Any:
    batch["padded"] = not bool(batch["attention_mask"].all())  # a CPU tensor here: no sync
    return batch


def _longest(samples: list[dict], size: int) -> list[dict]:
    """The `size` longest samples: with dynamic padding, the largest batch training can meet."""
    return sorted(samples, key=lambda s: len(s["input_ids"]), reverse=True)[:size]


def _tokenize(tokenizer: Any, rows: list[dict[str, Any]], fields: list[str], max_length: int) -> list[dict]:
    # str(): a column of numbers is text too (empty cells were refused by check_text)
    encoded = tokenizer(*[[str(row[f]) for row in rows] for f in fields], truncation=True,
                        max_length=max_length)
    return [{"id": i, **{k: encoded[k][i] for k in encoded}} for i in range(len(rows))]


class TextClassification:
    """Sentence(-pair) classification; exact accuracy (and F1 for 2 labels) summed across ranks."""

    eval_sum_keys = ("loss_sum", "count", "correct", "tp", "fp", "fn")

    def __init__(self, tokenizer: str, source: str = "embedded", path: str | None = None,
                 eval_path: str | None = None, name: str | None = None, task: str | None = None,
                 eval_split: str = "validation", text_fields: str | list[str] | None = None,
                 label_field: str = "label", num_labels: int = 2, max_length: int = 128,
                 pad_to_multiple_of: int | None = None, n_train: int = 2000, n_eval: int = 501, seed: int = 0):
        fields = text_columns(text_fields, GLUE_FIELDS.get(task or "", ["text"]) if source == "hub" else ["text"])
        columns = fields + [label_field]
        if source == "embedded":
            train_rows, eval_rows = sentiment_rows(n_train, seed), sentiment_rows(n_eval, seed + 1)
            wheres = ("the embedded train set", "the embedded eval set")
        elif source == "files":
            train_rows = load_file_rows(path or "", columns, texts=fields)
            eval_rows = load_file_rows(eval_path, columns, key="data.eval_path", texts=fields) if eval_path else []
            wheres = (f"data.path={path}", f"data.eval_path={eval_path}")
        elif source == "hub":
            train_rows = load_hub_rows(name or "", task, "train", columns)
            eval_rows = load_hub_rows(name or "", task, eval_split, columns)
            wheres = (f"data.name={name} data.task={task} (train)", f"data.name={name} data.task={task} ({eval_split})")
        else:
            raise DataError(f"data.source={source} is not one of embedded, files, hub")
        self.num_labels = num_labels
        self.labels = Labels(tokenizer, train_rows, label_field, num_labels, wheres[0])
        self.tokenizer = load_tokenizer(tokenizer)
        self.train_set = self._encode(train_rows, fields, label_field, wheres[0], max_length)
        self.eval_set = self._encode(eval_rows, fields, label_field, wheres[1], max_length) or None
        self.pad = DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=pad_to_multiple_of,
                                           return_tensors="pt")

    def _encode(self, rows: list[dict], fields: list[str], label_field: str, where: str,
                max_length: int) -> list[dict]:
        """Tokenized samples with their class ids; an empty cell or a label the model has no id for stops here,
        naming the file and the row (counted from 1, after the header)."""
        check_text(rows, fields, where, "data.text_fields")
        labels = [self.labels.id(row[label_field], where, number) for number, row in enumerate(rows, 1)]
        samples = _tokenize(self.tokenizer, rows, fields, max_length) if rows else []
        for sample, label in zip(samples, labels):
            sample["labels"] = label
        return samples

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return _mark_padding(self.pad([{k: v for k, v in s.items() if k != "id"} for s in samples]))

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(len(batch["labels"]))

    def largest_batch(self, size: int) -> dict[str, torch.Tensor]:
        return self.collate(_longest(self.train_set, size))

    def write_model_files(self, model: torch.nn.Module, directory: Path) -> None:
        write_pretrained_files(model, self.tokenizer, directory, self.labels)

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**model_inputs(model, batch)).logits
        return F.cross_entropy(_fp32(logits), batch["labels"], reduction="sum")

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = _fp32(model(**model_inputs(model, batch)).logits)
        labels, predicted = batch["labels"], logits.argmax(-1)
        return {"loss_sum": F.cross_entropy(logits, labels, reduction="sum"), "count": self.count_items(batch),
                "correct": (predicted == labels).sum(), "tp": ((predicted == 1) & (labels == 1)).sum(),
                "fp": ((predicted == 1) & (labels == 0)).sum(), "fn": ((predicted == 0) & (labels == 1)).sum()}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        metrics = {"loss": sums["loss_sum"] / sums["count"], "accuracy": sums["correct"] / sums["count"]}
        if self.num_labels == 2:
            metrics["f1"] = 2 * sums["tp"] / max(2 * sums["tp"] + sums["fp"] + sums["fn"], 1)
        return metrics


class MaskedLM:
    """Masked-LM pre-training: 15% of tokens masked (80% [MASK], 10% random, 10% kept), per sample.

    Masks are drawn once per sample from (seed, sample id), so a step's batch, and so the trajectory,
    does not depend on how the step is split over ranks and micro-batches.
    """

    eval_sum_keys = ("loss_sum", "count", "correct")

    def __init__(self, tokenizer: str, source: str = "embedded", path: str | None = None,
                 eval_path: str | None = None, name: str | None = None, task: str | None = None,
                 eval_split: str = "validation", text_field: str = "text", max_length: int = 128,
                 pad_to_multiple_of: int | None = None, mlm_probability: float = 0.15, n_train: int = 4000,
                 n_eval: int = 400, seed: int = 0):
        if source == "embedded":
            train_rows, eval_rows = corpus_lines(n_train, seed), corpus_lines(n_eval, seed + 1)
        elif source == "files":
            train_rows = text_file_rows(path or "", text_field, "data.path")
            eval_rows = text_file_rows(eval_path, text_field, "data.eval_path") if eval_path else []
        elif source == "hub":
            train_rows = load_hub_rows(name or "", task, "train", [text_field])
            eval_rows = load_hub_rows(name or "", task, eval_split, [text_field])
        else:
            raise DataError(f"data.source={source} is not one of embedded, files, hub")
        self.tokenizer = load_tokenizer(tokenizer)
        self.seed, self.mlm_probability = seed, mlm_probability
        self.train_set = [self._mask(s) for s in _tokenize(self.tokenizer, train_rows, [text_field], max_length)]
        eval_set = _tokenize(self.tokenizer, eval_rows, [text_field], max_length) if eval_rows else []
        self.eval_set = [self._mask(s, salt=1) for s in eval_set] or None
        self.pad = DataCollatorForTokenClassification(self.tokenizer, label_pad_token_id=-100,
                                                      pad_to_multiple_of=pad_to_multiple_of,
                                                      return_tensors="pt")

    def _mask(self, sample: dict, salt: int = 0) -> dict:
        ids = torch.tensor(sample["input_ids"])
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + sample["id"]) * 2 + salt)
        special = torch.tensor(self.tokenizer.get_special_tokens_mask(sample["input_ids"],
                                                                      already_has_special_tokens=True)).bool()
        chosen = (torch.rand(len(ids), generator=generator) < self.mlm_probability) & ~special
        action = torch.rand(len(ids), generator=generator)
        random_ids = torch.randint(len(self.tokenizer), ids.shape, generator=generator)
        inputs = torch.where(chosen & (action < 0.8), self.tokenizer.mask_token_id, ids)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
        return {**sample, "input_ids": inputs.tolist(), "labels": torch.where(chosen, ids, -100).tolist()}

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = _mark_padding(self.pad([{k: v for k, v in s.items() if k != "id"} for s in samples]))
        batch["masked_positions"] = _masked_positions(batch["labels"])
        return batch

    def largest_batch(self, size: int) -> dict[str, torch.Tensor]:
        return self.collate(_longest(self.train_set, size))

    def write_model_files(self, model: torch.nn.Module, directory: Path) -> None:
        write_pretrained_files(model, self.tokenizer, directory)

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(len(batch["masked_positions"]))  # the loss tokens: normalised by their global count

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**model_inputs(model, batch), labels=batch["labels"])[0]

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss_sum, logits = model(**model_inputs(model, batch), labels=batch["labels"])
        targets = batch["labels"].flatten().index_select(0, batch["masked_positions"])
        return {"loss_sum": loss_sum, "count": self.count_items(batch),
                "correct": (logits.argmax(-1) == targets).sum()}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums["count"], 1)
        return {"loss": sums["loss_sum"] / count, "accuracy": sums["correct"] / count}
