"""Class labels of the classification job: which id each label of a data file is, and their names for config.json.

Exercised by: tests/test_own_data.py (`python -m launcher +exp=bert data=files data.path=train.csv ...`).
"""
from __future__ import annotations

from typing import Any

from transformers import AutoConfig

from jobs.text import DataError, is_missing


def _listed(names: list[Any], most: int = 10) -> str:
    """A label list short enough for one line (a text column taken for the label column has thousands)."""
    return str(names) if len(names) <= most else f"{str(names[:most])[:-1]}, ... ({len(names)} in all)]"


def checkpoint_label_names(pretrained: str) -> list[str] | None:
    """The names in id order of a fine-tuned classifier's config.json (id2label), None where it has none: no config
    (a tokenizer-only dir, a hub id offline) or transformers' default LABEL_0, LABEL_1, ... (a model that was never
    given names: a pre-trained BERT, an MLM checkpoint, a classifier trained on integer labels)."""
    try:
        id2label = AutoConfig.from_pretrained(pretrained).id2label or {}
    except (OSError, ValueError):  # no config.json there: the model's own load says why, if it fails too
        return None
    names = [id2label[i] for i in sorted(id2label)]
    return None if all(name == f"LABEL_{i}" for i, name in enumerate(names)) else names


class Labels:
    """String labels map to ids by their names (id order); integer labels are ids already.

    The names are those of the checkpoint data.tokenizer names (model.pretrained by default; a run dir stands for
    its checkpoint), so that a fine-tuned classifier is trained on and evaluated with the mapping it learned; a
    new classifier takes the sorted string labels of the train rows (never the eval rows: an eval file must not
    move the ids). write_model_files saves them as config.json's id2label.
    """

    def __init__(self, pretrained: str, train_rows: list[dict[str, Any]], label_field: str, num_labels: int,
                 train_where: str):
        self.num_labels, self.label_field = num_labels, label_field
        self.first_of: dict[str, tuple[int, Any]] = {}  # each file's first label (row, value), by where
        self.names = checkpoint_label_names(pretrained)
        if self.names is not None:
            self.origin = f"id2label in the config.json of data.tokenizer={pretrained}"
            if len(self.names) != num_labels:
                raise DataError(f"data.num_labels={num_labels} but data.tokenizer={pretrained} is a classifier of "
                                 f"{len(self.names)} labels {_listed(self.names)}; set "
                                 f"data.num_labels={len(self.names)}")
            self.advice = ("correct or drop those rows, or start from a model without label names (a pre-trained one, "
                           "not a fine-tuned classifier)")
            self.ids = {name: i for i, name in enumerate(self.names)}
            return
        names = sorted({row[label_field] for row in train_rows if isinstance(row[label_field], str)})
        self.names, self.ids = names or None, {name: i for i, name in enumerate(names)}
        self.origin, self.train_where = f"the labels of {train_where}, sorted", train_where
        if len(names) > num_labels:
            raise DataError(f"{train_where} has {len(names)} labels {_listed(names)} in column {label_field!r} "
                             f"(data.label_field), more than data.num_labels={num_labels}; set "
                             f"data.num_labels={len(names)}")
        self.advice = f"drop those rows, or add rows with that label to {train_where}"

    def id(self, value: Any, where: str, row: int) -> int:
        """The class id of one row's label; a ValueError naming the file key and the row where there is none."""
        at = f"{where} row {row}: "
        if is_missing(value):
            raise DataError(f"{at}no label in column {self.label_field!r} (data.label_field); fill it in or drop "
                             f"the row")
        first = self.first_of.setdefault(where, (row, value))  # names and ids do not mix in one file (JSONL can)
        if isinstance(first[1], str) != isinstance(value, str):
            raise DataError(f"{at}label {value!r} is {'a name' if isinstance(value, str) else 'a class id'}, but row "
                             f"{first[0]}'s label {first[1]!r} is not (data.label_field); give every row an integer "
                             f"id, or every row a name")
        if isinstance(value, str):
            if self.names is None:
                raise DataError(f"{at}label {value!r} is a name, but the labels of {self.train_where} are class ids "
                                 f"(integers); give every row an integer id, or every row a name")
            if value not in self.ids:
                raise DataError(f"{at}label {value!r} is not one of the labels the model is trained on "
                                 f"{_listed(self.names)} ({self.origin}); {self.advice}")
            return self.ids[value]
        if isinstance(value, float) and value.is_integer():  # a column of ints with an empty cell reads as floats
            value = int(value)
        if not isinstance(value, int):  # bool is an int: JSON's true/false are ids 1/0
            raise DataError(f"{at}label {value!r} in column {self.label_field!r} (data.label_field) is not a class: "
                             f"give integer class ids or names (this job classifies, it does not regress)")
        if not 0 <= value < self.num_labels:
            raise DataError(f"{at}label {value} is outside data.num_labels={self.num_labels} (class ids "
                             f"0..{self.num_labels - 1}); set data.num_labels to the number of classes")
        return int(value)

    def id2label(self, num_labels: int) -> dict[int, str] | None:
        """config.json's id2label for a head of num_labels outputs: the names, LABEL_<id> for ids without one
        (a train file that holds fewer labels than data.num_labels); None for integer labels without names."""
        if self.names is None:
            return None
        return {i: self.names[i] if i < len(self.names) else f"LABEL_{i}" for i in range(num_labels)}
