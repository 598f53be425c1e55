"""A text job's tokenizer, checked in the parent: it has files to load from, and no more token ids than its model's
embeddings hold (its added tokens too: tokenizer.add_tokens). By key name (data.tokenizer, model.pretrained), as
launcher/launch/checks.py's other checks.

Without any tokenizer file in its dir, transformers 5 makes a tokenizer of its 5 special tokens from the model's
config: a run trained on every word as [UNK], exit 0. A tokenizer of more words than the model's vocab_size gives
ids past its embedding: `IndexError: index out of range in self` on every rank (a device assert on CUDA). So do
tokens added past the rows, unless the model grows its embeddings to them (model.tokenizer: the BERT jobs,
jobs/vocab.py); more words than the rows is another vocabulary, refused either way.
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
    checkpoint), else their values (a hub id: checked as it loads). `grows`: the model takes data.tokenizer
    (model.tokenizer, the BERT jobs'), whose added tokens it makes embedding rows for (jobs/vocab.py)."""
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
    counted = _ids(Path(tokenizer))
    rows = _vocab_size(Path(model_dir)) if isinstance(model_dir, str) else None
    if not counted or not rows:
        return
    ids, base, added = counted
    if base > rows:  # another vocabulary than the model's: growing the embeddings would not make it the model's
        raise ConfigError(f"{said} has {base} words, more than the {rows} of model.pretrained={pretrained}'s "
                          f"embeddings (vocab_size): a word past them fails in the model; give the model's own "
                          f"tokenizer (data.{TOKENIZER_KEY}), or a model of this tokenizer's vocabulary")
    past = [added[i] for i in sorted(added) if i >= rows]
    if past and not grows:
        raise ConfigError(f"{said} has {ids} token ids, {len(past)} added past the {rows} rows of "
                          f"model.pretrained={pretrained}'s embeddings ({', '.join(past[:3])}"
                          f"{', ...' * (len(past) > 3)}): such a token fails in the model; model=bert_cls and bert_mlm "
                          f"grow their embeddings to them unless model.{TOKENIZER_KEY} is set otherwise than "
                          f"data.{TOKENIZER_KEY} (drop that override), "
                          f"another model must grow them itself (resize_token_embeddings)")


def _ids(directory: Path) -> tuple[int, int, dict[int, str]] | None:
    """The ids a tokenizer gives (the largest of its vocabulary's and its added tokens', + 1), its vocabulary's words,
    and its added tokens by id (tokenizer.add_tokens), from tokenizer.json, or vocab.txt, and the added tokens of
    tokenizer_config.json (a vocab.txt's: added_tokens.json before transformers 4.34); None where neither says."""
    try:
        config, old = directory / "tokenizer_config.json", directory / "added_tokens.json"
        decoder = (json.loads(config.read_text()).get("added_tokens_decoder") or {}) if config.is_file() else {}
        listed = {int(i): entry["content"] for i, entry in decoder.items()}  # (transformers adds them to either file's)
        if (directory / "tokenizer.json").is_file():
            saved = json.loads((directory / "tokenizer.json").read_text())
            vocab = saved["model"]["vocab"]
            base = (max(vocab.values()) + 1 if vocab else 0) if isinstance(vocab, dict) else len(vocab)
            added = {**listed, **{entry["id"]: entry["content"] for entry in saved.get("added_tokens") or []}}
        elif (directory / "vocab.txt").is_file():
            base = sum(1 for _ in (directory / "vocab.txt").open(encoding="utf-8"))
            added = listed or ({i: token for token, i in json.loads(old.read_text()).items()} if old.is_file() else {})
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a format of its own: the model tells
        return None
    return max(base, max(added, default=-1) + 1), base, added


def _vocab_size(directory: Path) -> int | None:
    """The model's embedding rows (config.json's vocab_size), or None where its config does not say."""
    try:
        size = json.loads((directory / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None
