"""A BERT job's embeddings grown to its tokenizer's words (model.tokenizer): tokens added to a tokenizer
(tokenizer.add_tokens, then save_pretrained) have ids past the rows of the model they came with.

Without it an added token in a text failed in the embedding on every rank (`IndexError: index out of range in self`;
a device-side assert on CUDA), and the MLM's random replacements, drawn from the whole tokenizer, failed at a step
of their own. transformers' recipe is resize_token_embeddings(len(tokenizer)); the new rows start near the mean of
the others (its mean_resizing, transformers 4.46 on: drawn from their mean and covariance; before, random), a tied
MLM decoder and its bias grow with them, and the checkpoints' config.json says the new vocab_size, so a run dir given
as model.pretrained loads as it trained. A tokenizer of another vocabulary (more words than the rows) is refused.
Exercised by: tests/test_added_tokens.py.
"""
from __future__ import annotations

import inspect
import os
from functools import lru_cache
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer

from jobs.text import DataError

MEAN_RESIZING = "mean_resizing" in inspect.signature(transformers.PreTrainedModel.resize_token_embeddings).parameters


@lru_cache(maxsize=2)
def load_tokenizer(tokenizer: str) -> Any:
    """AutoTokenizer.from_pretrained, once per process: the data task loads it, then the model's build reads its size
    (neither changes it)."""
    return AutoTokenizer.from_pretrained(tokenizer)


def fit_embeddings(model: transformers.PreTrainedModel, tokenizer: str | None) -> transformers.PreTrainedModel:
    """`model` with an embedding row for each of the tokenizer's ids (len(tokenizer): its added tokens too); as it
    was where it has as many (null: the model's own, as given)."""
    if tokenizer is None:
        return model
    loaded, rows = load_tokenizer(tokenizer), model.get_input_embeddings().num_embeddings
    words = len(loaded)
    if words <= rows:
        return model
    if loaded.vocab_size > rows:  # another vocabulary (the parent refuses it for local dirs): its rows would be new
        raise DataError(f"the tokenizer {tokenizer} has {loaded.vocab_size} words, more than the {rows} rows of the "
                        f"model's embeddings: it is another vocabulary than the model's; give the model's own "
                        f"tokenizer (data.tokenizer), or a model of this tokenizer's vocabulary")
    # on the meta device (strategy=fsdp's ranks but 0) there are no values to take a mean of: rank 0's rows come
    meta = torch.get_default_device().type == "meta"
    verbosity, _ = transformers.logging.get_verbosity(), transformers.logging.set_verbosity_error()  # its notice of
    try:  # the mean, a paragraph: said below in a line
        model.resize_token_embeddings(words, **({"mean_resizing": not meta} if MEAN_RESIZING else {}))
    finally:
        transformers.logging.set_verbosity(verbosity)
    if os.environ.get("RANK", "0") == "0":
        start = "near the mean of the others" if MEAN_RESIZING else "random, as a new layer's"
        print(f"the tokenizer {tokenizer} has {words} tokens, {words - rows} more than the {rows} rows of the model's "
              f"embeddings: grown to {words} (the new rows start at {start})", flush=True)
    return model
