"""A text job's tokenizer, checked in the parent: it has files to load from, and no more words than its model's
embeddings hold. By key name (data.tokenizer, model.pretrained), as launcher/launch/checks.py's other checks.

Without any tokenizer file in its dir, transformers 5 makes a tokenizer of its 5 special tokens from the model's
config: a run trained on every word as [UNK], exit 0. A tokenizer of more words than the model's vocab_size gives
ids past its embedding: `IndexError: index out of range in self` on every rank (a device assert on CUDA), unless
the model grows its embeddings to the tokenizer (model.tokenizer: the BERT jobs, jobs/vocab.py).
Exercised by: tests/test_own_data.py, tests/test_added_tokens.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.derived import ConfigError

TOKENIZER_KEY = "tokenizer"  # the dir or hub id a text job's tokenizer loads from (data.tokenizer)
# what save_pretrained writes of a tokenizer, one at least (tokenizer_config.json alone: a byte-level one, ByT5's),
# or a file of a kind (sentencepiece's *.model: DeBERTa's spm.model; Marian's source.spm; tiktoken's)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")
TOKENIZER_KINDS = ("*.model", "*.spm", "*.tiktoken")


def check_tokenizer(data: dict[str, Any], tokenizer: Any, pretrained: Any, model_dir: Any, grows: bool) -> None:
    """`tokenizer`, `model_dir`: the dirs data.tokenizer and model.pretrained (`pretrained`) stand for (a run dir's
    checkpoint), else their values (a hub id: checked as it loads). `grows`: the model takes a tokenizer
    (model.tokenizer, the BERT jobs'), whose words it makes embedding rows for (jobs/vocab.py)."""
    if not isinstance(tokenizer, str) or not Path(tokenizer).is_dir():
        return
    named = "model.pretrained" if data[TOKENIZER_KEY] == pretrained else f"data.{TOKENIZER_KEY}"
    said = f"{named}={data[TOKENIZER_KEY]}" + ("" if tokenizer == data[TOKENIZER_KEY] else
                                               f" (its checkpoint {tokenizer})")
    if not any((Path(tokenizer) / name).is_file() for name in TOKENIZER_FILES) and \
            not any(next(Path(tokenizer).glob(kind), None) for kind in TOKENIZER_KINDS):
        raise ConfigError(f"{said} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...), and a tokenizer "
                          f"made without them knows no word; save the tokenizer there too (tokenizer.save_pretrained), "
                          f"or give data.{TOKENIZER_KEY}=<a dir or hub id that has one>")
    words = _words(Path(tokenizer))
    embedded = _vocab_size(Path(model_dir)) if isinstance(model_dir, str) else None
    if words and embedded and words > embedded and not grows:
        raise ConfigError(f"{said} has {words} words, more than the {embedded} of model.pretrained={pretrained}'s "
                          f"embeddings (vocab_size): a word past them fails in the model; give the model's own "
                          f"tokenizer (data.{TOKENIZER_KEY}), a model of this tokenizer's vocabulary, or a model "
                          f"that grows its embeddings to it (model.{TOKENIZER_KEY}=${{data.{TOKENIZER_KEY}}}, as "
                          f"model=bert_cls)")


def _words(directory: Path) -> int | None:
    """The words of the tokenizer's own vocabulary (its added tokens left out: special ones may never come in text),
    from tokenizer.json or vocab.txt; None where neither says."""
    try:
        if (directory / "tokenizer.json").is_file():
            vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
            return (max(vocab.values()) + 1 if vocab else 0) if isinstance(vocab, dict) else len(vocab)
        if (directory / "vocab.txt").is_file():
            return sum(1 for _ in (directory / "vocab.txt").open(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a format of its own: the model tells
        return None
    return None


def _vocab_size(directory: Path) -> int | None:
    """The model's embedding rows (config.json's vocab_size), or None where its config does not say."""
    try:
        size = json.loads((directory / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None
