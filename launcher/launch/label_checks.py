"""The label column of a classifier's data files (a data section that names num_labels), checked in the parent as
the job's labels (jobs/labels.py) check it in every worker after their start-up: launcher/ never imports jobs/, so
this reads the file itself, typed as the job's reader (datasets) types it, and says the job's line.

Exercised by: `python -m launcher +exp=bert data=files data.path=train.csv` with an empty label cell (exit 2).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Iterator

from launcher.derived import ConfigError
from launcher.launch.data_files import DIALECTS

NUM_LABELS_KEY = "num_labels"  # a data section that names it classifies: its labels are class ids or names
UNKNOWN = "unknown"  # the label names of a model the parent cannot read (a hub id): the job checks names itself


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))  # NaN: pandas' empty cell


def _listed(names: list[Any], most: int = 10) -> str:
    return str(names) if len(names) <= most else f"{str(names[:most])[:-1]}, ... ({len(names)} in all)]"


def read_labels(path: Path, field: str, most_bytes: int) -> list[Any] | None:
    """The label column of a CSV / TSV / JSON Lines / Parquet file, each value as the job's reader gives it; None where
    the parent leaves the file to the job (another format, over most_bytes, a file its reader fails on)."""
    if path.suffix not in (*DIALECTS, ".jsonl", ".parquet") or path.stat().st_size > most_bytes:
        return None
    try:
        if path.suffix in DIALECTS:
            # pandas, as datasets reads a CSV: it types the column (1 and 2 are ids, 0.4 a float, an int column with an
            # empty cell floats, NA and empty cells missing: jobs/text.py keeps pandas' missing cells in the label
            # column), which only its own parser tells exactly
            import pandas as pd  # here: a slow import that only a CSV's labels need

            dialect = DIALECTS[path.suffix]
            return pd.read_csv(path, usecols=[field], sep=dialect.get("delimiter", ","),
                               quoting=dialect.get("quoting", csv.QUOTE_MINIMAL))[field].tolist()
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=[field]).column(0).to_pylist()
        with open(path, encoding="utf-8-sig") as f:  # JSON Lines: each row's value as it is written
            return [json.loads(line).get(field) for line in f if line.strip()]
    except Exception:  # no such column, a line that is no JSON object, a CSV pandas cannot parse: the job names it
        return None


def checkpoint_names(model_dir: Any) -> list[str] | None | str:
    """The label names in id order of the classifier data.tokenizer names (its config.json's id2label), None where
    it has none (no config.json, or transformers' default LABEL_0, LABEL_1, ...), UNKNOWN where the parent cannot
    tell (a hub id, a run dir without a checkpoint yet)."""
    if not isinstance(model_dir, str) or not Path(model_dir).is_dir():
        return UNKNOWN
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except OSError:  # no config.json: the job's AutoConfig finds none either
        return None
    except ValueError:
        return UNKNOWN
    if not isinstance(config, dict) or "model_type" not in config:  # transformers may refuse or guess it: the job tells
        return UNKNOWN
    try:
        id2label = {int(i): name for i, name in (config.get("id2label") or {}).items()}
    except (AttributeError, TypeError, ValueError):  # no {id: name} map: transformers' own error, in the job
        return UNKNOWN
    names = [id2label[i] for i in sorted(id2label)]
    return None if all(name == f"LABEL_{i}" for i, name in enumerate(names)) else names


def check_labels(data: dict[str, Any], model_dir: Any, most_bytes: int) -> None:
    """What the job's labels would refuse in data.path and data.eval_path, in its order: a model's names against
    data.num_labels, then each file's rows; `model_dir` is the dir data.tokenizer stands for."""
    field, num_labels = data.get("label_field"), data.get(NUM_LABELS_KEY)
    if not isinstance(field, str) or not isinstance(num_labels, int) or not data.get("path"):
        return
    train_where = f"data.path={data['path']}"
    train = read_labels(Path(data["path"]), field, most_bytes)
    names = checkpoint_names(model_dir)
    if names == UNKNOWN or train is None:  # the names would be unknown: check only what needs none
        names, ids, advice = UNKNOWN, {}, ""
    elif names is not None:
        if len(names) != num_labels:
            raise ConfigError(f"data.num_labels={num_labels} but data.tokenizer={model_dir} is a classifier of "
                              f"{len(names)} labels {_listed(names)}; set data.num_labels={len(names)}")
        origin = f"id2label in the config.json of data.tokenizer={model_dir}"
        advice = (f" ({origin}); correct or drop those rows, or start from a model without label names (a "
                  f"pre-trained one, not a fine-tuned classifier)")
        ids = {name: i for i, name in enumerate(names)}
    else:
        names = sorted({value for value in train if isinstance(value, str)})
        if len(names) > num_labels:
            raise ConfigError(f"{train_where} has {len(names)} labels {_listed(names)} in column {field!r} "
                              f"(data.label_field), more than data.num_labels={num_labels}; set "
                              f"data.num_labels={len(names)}")
        ids = {name: i for i, name in enumerate(names)}
        names = names or None
        advice = (f" (the labels of {train_where}, sorted); drop those rows, or add rows with that label to "
                  f"{train_where}")
    for key in ("path", "eval_path"):
        values = train if key == "path" else read_labels(Path(data[key]), field, most_bytes) if data.get(key) else None
        for number, problem in _problems(values or [], field, num_labels, names, ids, train_where, advice):
            raise ConfigError(f"data.{key}={data[key]} row {number}: {problem}")


def _problems(values: list[Any], field: str, num_labels: int, names: list[str] | None | str, ids: dict[str, int],
              train_where: str, advice: str) -> Iterator[tuple[int, str]]:
    """(row, what is wrong) for the rows of one file the job would refuse, in row order."""
    first = None  # (row, value) of the file's first label: names and ids do not mix in one file
    for number, value in enumerate(values, 1):
        if _missing(value):
            yield number, f"no label in column {field!r} (data.label_field); fill it in or drop the row"
            continue
        first = first or (number, value)
        if isinstance(first[1], str) != isinstance(value, str):
            kind = "a name" if isinstance(value, str) else "a class id"
            yield number, (f"label {value!r} is {kind}, but row {first[0]}'s label {first[1]!r} is not (data.label_"
                           f"field); give every row an integer id, or every row a name")
        elif isinstance(value, str):
            if names is None:
                yield number, (f"label {value!r} is a name, but the labels of {train_where} are class ids "
                               f"(integers); give every row an integer id, or every row a name")
            elif names != UNKNOWN and value not in ids:
                yield number, (f"label {value!r} is not one of the labels the model is trained on "
                               f"{_listed(names)}{advice}")
        else:
            value = int(value) if isinstance(value, float) and value.is_integer() else value
            if not isinstance(value, int):  # bool is an int: JSON's true/false are ids 1/0
                yield number, (f"label {value!r} in column {field!r} (data.label_field) is not a class: give integer "
                               f"class ids or names (this job classifies, it does not regress)")
            elif not 0 <= value < num_labels:
                yield number, (f"label {value} is outside data.num_labels={num_labels} (class ids "
                               f"0..{num_labels - 1}); set data.num_labels to the number of classes")
