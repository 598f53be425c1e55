"""The files beside a checkpoint's model.safetensors that make checkpoints/<step>/ a save_pretrained dir: config.json
and the tokenizer (Task.write_model_files of the BERT jobs). Exercised by: tests/test_pretrained_runs.py."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from jobs.attention import hf_model
from jobs.labels import Labels

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def write_pretrained_files(model: torch.nn.Module, tokenizer: Any, directory: Path,
                           labels: Labels | None = None) -> None:
    """config.json and the tokenizer beside a checkpoint's model.safetensors: from_pretrained loads it as any
    save_pretrained dir. The architecture named is transformers' own class (BertMaskedLMSum's: BertForMaskedLM);
    a classifier's label names are its id2label (pipelines show them; a run from this checkpoint maps by them)."""
    hf = hf_model(model)
    config = copy.deepcopy(hf.config)
    id2label = labels.id2label(config.num_labels) if labels else None
    if id2label:
        config.id2label, config.label2id = id2label, {name: i for i, name in id2label.items()}
    config.architectures = [next(c.__name__ for c in type(hf).__mro__ if c.__module__.startswith("transformers."))]
    # the weights' own dtype, as from_pretrained's dtype="auto" reads it (transformers 4: torch_dtype)
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", _weights_dtype(directory))
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _weights_dtype(directory: Path) -> torch.dtype:
    """The dtype of the weights in directory's model.safetensors (its first floating tensor), read from the file's
    header. Not the module's: these files are written by the checkpoint's writer thread while training goes on,
    and under strategy=fsdp with bf16/fp16 the module holds its unsharded half-precision copies mid-step."""
    path = directory / "model.safetensors"
    with safe_open(str(path), framework="pt") as weights:
        dtypes = (SAFETENSORS_DTYPES.get(weights.get_slice(name).get_dtype()) for name in weights.keys())
        found = next((dtype for dtype in dtypes if dtype is not None), None)
    if found is None:
        raise ValueError(f"{path} holds no tensor in {', '.join(map(str, SAFETENSORS_DTYPES.values()))}: no dtype "
                         f"for its config.json")
    return found
