"""Checks of common job conventions, in the parent before any worker starts: local files that exist, hold rows
(data_files.py) and the named columns (one text or a pair), a classifier's labels (label_checks.py), lengths
within the model's positions, dtypes torch has, a tokenizer that fits its model (tokenizer_check.py), model ids
that can load offline, run dirs named as a pretrained model that have a checkpoint to start from. By key name
only: launcher/ never imports jobs/.

Exercised by: `python -m launcher +exp=bert data=files data.path=missing.csv` (one-line error, exit 2).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from launcher.derived import CHECKPOINTING_KEY, ConfigError
from launcher.launch.data_files import (MAX_SCANNED_BYTES, columns_of, first_bad_row, has_rows, not_utf8,
                                        split_by_another)
from launcher.launch.label_checks import check_labels
from launcher.launch.tokenizer_check import TOKENIZER_KEY, check_tokenizer
from launcher.rundir import PRETRAINED_KEYS, is_run_dir, newest_checkpoint, pinned_checkpoint

PATH_KEYS = ("path", "eval_path")  # data files a job reads
# where a text job's samples come from: files reads PATH_KEYS, these others leave them unread (a job of the user's
# may have sources of its own that read them: not refused)
SOURCE_KEY, FILES_SOURCE, OTHER_SOURCES = "source", "files", ("embedded", "hub")
COLUMN_KEYS = ("text_fields", "label_field", "text_field")  # columns a tabular file must hold
TEXT_FIELDS_KEY = "text_fields"  # columns tokenized together: a text, or a pair (a tokenizer takes no third)
LENGTH_KEY = "max_length"  # tokens per sample a text job keeps (data.max_length)
DROPOUT_KEY = "dropout"  # a probability that overrides the model's (model.dropout)
DTYPE_KEY = "dtype"  # the name of a torch dtype the job makes its tensors in (model.dtype: float32, bfloat16)
# tokens a text job's batches are padded to a multiple of (data.pad_to_multiple_of; null: each batch's longest)
PAD_KEY = "pad_to_multiple_of"
# model_types whose position ids start after the padding id (RoBERTa's create_position_ids_from_input_ids): of
# max_position_embeddings, the first pad_token_id + 1 are never a token's
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "data2vec-text",
                    "longformer", "mpnet", "ibert", "luke", "xmod")


def _offline() -> bool:
    return any(os.environ.get(v, "0").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache
def _hub_problem(repo_id: str) -> str | None:
    """Why the workers could not load a hub id the machine's cache lacks, asked of the hub once (seconds at most): with
    no network every rank's transformers retried for over a minute, then failed in the tokenizer (data._target_) with
    a screen of tracebacks."""
    from huggingface_hub import model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None  # (a cached model's files load without the hub)
    try:
        model_info(repo_id, timeout=10)
        return None
    except Exception as error:  # noqa: BLE001 - httpx's or requests' errors, by huggingface_hub's version
        kinds = {kind.__name__ for kind in type(error).__mro__}
        why = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        if "RepositoryNotFoundError" in kinds:  # (a gated one too: it needs a token, huggingface-cli login)
            return f"the hub has no model of that name that this machine may read ({why}); check the name"
        return (f"not in this machine's Hugging Face cache, and the hub does not answer ({type(error).__name__}: "
                f"{why}); download it where the hub answers (hf download {repo_id}), or give a local dir written by "
                f"save_pretrained")


def _near_miss(value: str) -> str:
    """What the dir above a path that is no dir holds, where that dir is here; else ""."""
    parent = Path(value).parent
    if "/" not in value or not parent.is_dir() or parent == Path(parent.anchor):  # (not a listing of / itself)
        return ""
    there = sorted(p.name for p in parent.iterdir() if p.is_dir())
    return f"{parent}/ holds {', '.join(there[:8]) + (', ...' if len(there) > 8 else '') or 'no dir'}"


def check_job_inputs(config: dict[str, Any], pinned: dict[str, dict[str, str]]) -> None:
    """`pinned`: this run dir's pinned_pretrained, the checkpoints its earlier starts built from."""
    _check_source(config.get("data") or {})  # before the files' own checks: a file that is not there would be unread
    given = (config.get("data") or {}).get(TOKENIZER_KEY)  # the model grows its embeddings to this tokenizer's added
    grows = given is not None and (config.get("model") or {}).get(TOKENIZER_KEY) == given  # tokens (jobs/vocab.py)
    for group in ("model", "data"):  # model first: data.tokenizer usually repeats model.pretrained
        section = config.get(group) or {}
        for key in PATH_KEYS:
            value = section.get(key)
            if value and not Path(value).is_file():
                raise ConfigError(f"{group}.{key}={value} does not exist; give an existing file")
        for key in PRETRAINED_KEYS:
            value = section.get(key)
            if group == "model" and key == TOKENIZER_KEY and grows:
                continue  # the BERT models' ${data.tokenizer}: told as the data's key, which the user gave
            if is_run_dir(value):
                if not pinned_checkpoint(pinned, f"{group}.{key}", value):  # later starts build from the pinned one
                    _check_pretrained_run(f"{group}.{key}", value, (config.get("launcher") or {}).get("after"))
                continue
            if not isinstance(value, str) or Path(value).is_dir():
                continue
            near = _near_miss(value)  # (runs/pretrian where runs/ is here: a mistyped dir, more likely than an org)
            if value.startswith(("/", ".", "~")) or value.count("/") > 1:  # a hub id is name or org/name
                raise ConfigError(f"{group}.{key}={value} is not a directory{f' ({near})' if near else ''}; give a dir "
                                  f"written by save_pretrained or a hub id such as bert-base-uncased")
            if near and _offline():
                raise ConfigError(f"{group}.{key}={value} is not a directory ({near}); give a dir written by "
                                  f"save_pretrained or a run dir")
            if _offline():
                raise ConfigError(f"{group}.{key}={value} is a hub id but the hub is off (HF_HUB_OFFLINE=1); it needs "
                                  f"the hub, or a local dir written by save_pretrained")
            # (a dry run plans, and asks no hub: README's commands run as written on a machine without one)
            problem = None if (config.get("launcher") or {}).get("dry_run") else _hub_problem(value)
            if problem:
                raise ConfigError(f"{group}.{key}={value}: {f'no such directory ({near}), nor ' if near else ''}"
                                  f"{problem}")
    dropout = (config.get("model") or {}).get(DROPOUT_KEY)
    probability = isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1
    if dropout is not None and not probability:
        raise ConfigError(f"model.dropout={dropout} must be a probability in [0, 1); null keeps the model's own")
    for group in ("data", "model"):  # model.dtype=float17 failed on every rank, after the model had loaded (data first:
        # the toy's model.dtype is ${data.dtype})
        dtype = (config.get(group) or {}).get(DTYPE_KEY)
        if isinstance(dtype, str) and not isinstance(getattr(torch, dtype, None), torch.dtype):
            name = dtype.removeprefix("torch.")
            fix = f"write {group}.{DTYPE_KEY}={name}" if isinstance(getattr(torch, name, None), torch.dtype) else \
                "e.g. float32, bfloat16 or float16"
            raise ConfigError(f"{group}.{DTYPE_KEY}={dtype} is not the name of a torch dtype; {fix}")
    checkpointing = (config.get("model") or {}).get(CHECKPOINTING_KEY)
    if checkpointing is not None and not isinstance(checkpointing, bool):
        raise ConfigError(f"model.{CHECKPOINTING_KEY}={checkpointing} must be true or false")
    data, pretrained = config.get("data") or {}, (config.get("model") or {}).get("pretrained")
    model_dir = _model_source(pretrained, pinned)  # (a run dir's checkpoint: found once, for the lengths and tokenizer)
    _check_lengths(data.get(LENGTH_KEY), data.get(PAD_KEY), model_dir)
    fields = data.get(TEXT_FIELDS_KEY)
    if isinstance(fields, list) and len(fields) > 2:  # the tokenizer would take a third as text_target, silently
        raise ConfigError(f"data.{TEXT_FIELDS_KEY}={fields} names {len(fields)} columns; the tokenizer takes a text "
                          f"or a pair of texts: name one or two (join the others into one column)")
    wanted = [c for key in COLUMN_KEYS for c in ([data[key]] if isinstance(data.get(key), str) else data.get(key) or [])]
    label = data.get("label_field")
    if isinstance(label, str) and label in ([fields] if isinstance(fields, str) else fields or []):
        raise ConfigError(f"data.label_field={label} is one of data.{TEXT_FIELDS_KEY}={fields}: the model would read "
                          f"the label it is to predict; name the label's column and the text's apart")
    for key in PATH_KEYS:
        path = Path(data[key]) if data.get(key) else None
        undecodable = not_utf8(path) if path else None
        if undecodable:
            raise ConfigError(f"data.{key}={path} {undecodable}")
        if path and not has_rows(path):
            unset = f", or set data.{key}=null" if key == "eval_path" else ""
            raise ConfigError(f"data.{key}={path} has no rows; give a file with at least one sample{unset}")
        columns = columns_of(path) if path else None
        missing = [c for c in wanted if columns is not None and c not in columns]
        if missing:
            fix = split_by_another(columns or [], missing, path) or (
                _columns_fix(data, missing, columns or []) if key == "path" else "rename its column(s) as in data.path")
            raise ConfigError(f"data.{key}={path} has no column(s) {missing} (its columns: {columns}); {fix}")
        texts = [c for k in (TEXT_FIELDS_KEY, "text_field") for c in ([data[k]] if isinstance(data.get(k), str)
                                                                     else data.get(k) or [])]
        bad = first_bad_row(path, texts) if path else None
        if bad:  # the workers would find it too, after seconds of start-up, on every rank
            raise ConfigError(f"data.{key}={path} {bad}")
    tokenizer = _model_source(data.get(TOKENIZER_KEY), pinned, f"data.{TOKENIZER_KEY}")
    check_tokenizer(data, tokenizer, pretrained, model_dir, grows)
    check_labels(data, tokenizer, MAX_SCANNED_BYTES)


def _columns_fix(data: dict[str, Any], missing: list[str], columns: list[str]) -> str:
    """The override that names the file's columns, where one key names the missing ones and as many columns are
    named by no key (text_fields=[text] of a file of sentence,label: data.text_fields=[sentence]); else what to set."""
    named = {key: [data[key]] if isinstance(data.get(key), str) else list(data.get(key) or []) for key in COLUMN_KEYS}
    spare = [c for c in columns if not any(c in names for names in named.values())]
    lacking = [key for key, names in named.items() if set(names) & set(missing)]
    # (a name of a space or a comma makes no override to paste as one shell argument)
    if len(lacking) == 1 and len(spare) == len([c for c in named[lacking[0]] if c in missing]) and \
            not any(c in name for name in spare for c in " ,'\"[]="):
        key, unnamed = lacking[0], iter(spare)
        names = [next(unnamed) if c in missing else c for c in named[key]]
        return f"set data.{key}={names[0] if isinstance(data[key], str) else '[' + ','.join(names) + ']'}"
    return "set data.text_fields / data.label_field to its columns"


def _check_source(data: dict[str, Any]) -> None:
    """A data file given to a job whose data.source is another (+exp=bert_mlm data.path=corpus.txt, without
    data.source=files) would train on the embedded set, silently: the job reads its files only from that source."""
    source = data.get(SOURCE_KEY)
    for key in PATH_KEYS:
        if source in OTHER_SOURCES and data.get(key):
            raise ConfigError(f"data.{key}={data[key]} is read only with data.{SOURCE_KEY}={FILES_SOURCE}, and "
                              f"data.{SOURCE_KEY} is {source} here; add data.{SOURCE_KEY}={FILES_SOURCE}")


def _check_pretrained_run(key: str, run_dir: str, after: str | None) -> None:
    """A run dir as a pretrained model at a run's first start: the workers build from its best (train.best_metric)
    or newest complete checkpoint, which must be a save_pretrained dir (the newest stands for all of that run's
    checkpoints: one job writes them); a run whose job this one waits for (launcher.after) has none yet."""
    newest = newest_checkpoint(Path(run_dir))
    if newest is None:
        if after and Path(after).resolve() == Path(run_dir).resolve():
            # its job completes before this one starts, with a final checkpoint: one of a model that loads
            # from_pretrained, if its own config names a pretrained model (the convention these checks go by)
            queued = _run_config(Path(run_dir))
            if "pretrained" not in (queued.get("model") or {}):
                raise ConfigError(f"{key}={run_dir}: that run's model ({(queued.get('model') or {}).get('_target_')}) "
                                  f"loads no pretrained model, so its checkpoints will be no save_pretrained dir")
            return
        raise ConfigError(f"{key}={run_dir} is a run dir without a complete checkpoint; train it first, or (launcher=slurm) "
                          f"add launcher.after={run_dir} to start once its job has completed")
    if not (newest / "config.json").is_file():
        raise ConfigError(f"{key}={run_dir}: its newest checkpoint {newest} has no config.json: a run dir stands for "
                          f"a save_pretrained dir, which its job's write_model_files does not write; give a dir written "
                          f"by save_pretrained, or the checkpoint itself ({key}={newest}) to a builder that reads it")


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config of another run (empty when it has none that reads back)."""
    try:
        return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    except Exception:  # missing, unreadable, not YAML: nothing to go by
        return {}


def _model_source(pretrained: Any, pinned: dict[str, dict[str, str]], key: str = "model.pretrained") -> Any:
    """What model.pretrained (or `key`) loads from, as far as the parent can tell: for a run dir the checkpoint it
    stands for (the pinned one, else its newest, a checkpoint of the same model as its best; None while it has
    none), else the value itself."""
    if not is_run_dir(pretrained):
        return pretrained
    checkpoint = pinned_checkpoint(pinned, key, pretrained) or newest_checkpoint(Path(pretrained))
    return str(checkpoint) if checkpoint else None


def _check_lengths(max_length: Any, pad: Any, pretrained: Any) -> None:
    """Truncation length: > 0 (0 would silently train untruncated); padding multiple: a positive int; both
    within the model's positions (a batch padded past them fails in the embedding, a device assert on CUDA)."""
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
        raise ConfigError(f"data.{PAD_KEY}={pad} is not a positive number of tokens; use null (pad each batch to "
                          f"its longest sample), 8 (tensor cores), or '${{data.max_length}}' (one shape for every batch)")
    if max_length is None:
        return
    if not isinstance(max_length, int) or max_length <= 0:
        raise ConfigError(f"data.max_length={max_length} is not a whole number > 0 (tokens kept per sample)")
    model_config = Path(pretrained) / "config.json" if isinstance(pretrained, str) else None
    if model_config is None or not model_config.is_file():  # a hub id: checked when the model loads
        return
    positions, why = _positions(json.loads(model_config.read_text()))
    if positions and max_length > positions:
        raise ConfigError(f"data.max_length={max_length} is more than the {positions} positions of "
                          f"model.pretrained={pretrained}{why}; set data.max_length<={positions}")
    padded = max_length if pad is None else -(-max_length // pad) * pad  # the longest batch, padded
    if positions and padded > positions:
        raise ConfigError(f"data.{PAD_KEY}={pad} pads batches of data.max_length={max_length} tokens to {padded}, "
                          f"more than the {positions} positions of model.pretrained={pretrained}{why}; use a divisor "
                          f"of {positions}, or '${{data.max_length}}'")


def _positions(model_config: dict[str, Any]) -> tuple[int | None, str]:
    """Tokens a model's position embeddings hold (None: its config does not say), and why where it is fewer than
    max_position_embeddings."""
    positions, model_type = model_config.get("max_position_embeddings"), model_config.get("model_type")
    if not positions or model_type not in OFFSET_POSITIONS:
        return positions, ""
    pad = model_config.get("pad_token_id")
    pad = 1 if pad is None else pad  # RoBERTa's default
    return positions - pad - 1, (f" ({model_type}: its position ids start at pad_token_id + 1 = {pad + 1}, of "
                                 f"max_position_embeddings={positions})")
