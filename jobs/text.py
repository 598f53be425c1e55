"""Text rows for the BERT jobs: an embedded offline default, local CSV/TSV/JSONL/Parquet files, or a hub dataset.

Rows are plain dicts (text fields + label). The embedded sets are generated deterministically, so
`python -m launcher +exp=bert` needs no network and no files. Exercised by: tests/test_bert.py.
"""
from __future__ import annotations

import csv
import math
import random
from pathlib import Path
from typing import Any

POSITIVE = ["good", "great", "excellent", "wonderful", "superb", "delightful", "brilliant", "lovely",
            "fantastic", "charming", "enjoyable", "pleasant", "impressive", "remarkable", "terrific",
            "beautiful", "outstanding", "moving", "clever", "fun", "solid", "memorable", "fresh", "warm"]
NEGATIVE = ["bad", "terrible", "awful", "horrible", "dreadful", "boring", "dull", "poor", "weak",
            "disappointing", "painful", "mediocre", "annoying", "bland", "clumsy", "forgettable", "messy",
            "tedious", "lifeless", "ugly", "stale", "sloppy", "flat", "pointless"]
SUBJECTS = ["the movie", "the film", "the plot", "the acting", "the soundtrack", "the ending", "the story",
            "the script", "the cast", "the dialogue", "this show", "the pacing", "the direction", "the food",
            "the service", "the book", "the album", "the game", "the hotel", "the trip", "the visuals"]
ADVERBS = ["", "", "really ", "truly ", "quite ", "very ", "so ", "rather ", "absolutely "]
TEMPLATES = ["{s} was {a}{w}.", "{s} is {a}{w}.", "i thought {s} was {a}{w}.", "honestly, {s} felt {a}{w}.",
             "{s} turned out {a}{w}.", "what a {w} experience, {s} was {a}{w}.", "overall {s} seemed {a}{w}.",
             "my friends said {s} was {a}{w} and they were right.", "{s}? {a}{w}."]
NEUTRAL = ["we watched it on a sunday evening", "the tickets were bought online", "it lasted about two hours",
           "we went with a group of friends", "the place was full of people", "it was released last year"]


def sentiment_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Short reviews labelled 1 (positive) or 0 (negative); one in ten is negated ("was not good")."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        negated = rng.random() < 0.1
        word = rng.choice(POSITIVE if label != negated else NEGATIVE)
        template = rng.choice(TEMPLATES[:-2] if negated else TEMPLATES)
        adverb = "not " if negated else rng.choice(ADVERBS)
        text = template.format(s=rng.choice(SUBJECTS), a=adverb, w=word)
        if rng.random() < 0.3:
            text = f"{rng.choice(NEUTRAL)}. {text}"
        rows.append({"text": text, "label": label})
    return rows


def corpus_lines(n: int, seed: int) -> list[dict[str, Any]]:
    """A small English-like corpus for masked-LM pre-training (reviews and plain statements)."""
    rng = random.Random(seed)
    return [{"text": " ".join(r["text"] for r in sentiment_rows(rng.randint(1, 3), rng.randrange(1 << 30)))}
            for _ in range(n)]


class DataError(ValueError):
    """A message about the job's input (a file, a row, a config key): the launcher shows its one line, no traceback."""

    one_line = True


def is_missing(value: Any) -> bool:
    """An empty cell: None from CSV/JSONL/Parquet, NaN where pandas wrote one."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def text_columns(text_fields: str | list[str] | None, default: list[str]) -> list[str]:
    """data.text_fields as a list: one column (a plain string is one, not its characters) or a pair."""
    fields = [text_fields] if isinstance(text_fields, str) else list(text_fields or default)
    if len(fields) > 2:  # the tokenizer's third positional argument is text_target: it would be dropped silently
        raise DataError(f"data.text_fields={fields} names {len(fields)} columns; the tokenizer takes a text or a "
                         f"pair of texts: name one or two (join the others into one column)")
    return fields


def check_text(rows: list[dict[str, Any]], fields: list[str], where: str, key: str) -> None:
    """Every row has its text (an empty cell would be tokenized as the word None)."""
    for number, row in enumerate(rows, 1):
        for field in fields:
            if is_missing(row[field]) or not str(row[field]).strip():
                raise DataError(f"{where} row {number}: no text in column {field!r} ({key}); fill it in or drop "
                                 f"the row")


def _blank(file: Path) -> bool:
    """Nothing but whitespace (read until the first byte that is not): a file datasets cannot read as empty."""
    with open(file, "rb") as f:
        return not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


def not_utf8(key: str, path: str, err: UnicodeDecodeError) -> DataError:
    """A file of another encoding, too big for the parent's scan (its position is left out: datasets' counts from
    a chunk of the file)."""
    return DataError(f"{key}={path} is no UTF-8 text (byte {err.object[err.start]:#04x}); save it as UTF-8")


def no_rows(key: str, path: str) -> DataError:
    unset = f", or set {key}=null" if key == "data.eval_path" else ""
    return DataError(f"{key}={path} has no rows; give a file with at least one sample{unset}")


def _check_columns(rows: list[dict[str, Any]], fields: list[str], where: str, key: str) -> None:
    missing = [f for f in fields if rows and f not in rows[0]]
    if missing:
        raise DataError(f"{key}={fields} but {where} has no column(s) {missing}; "
                         f"its columns are {sorted(rows[0])}")


# pandas' default missing cells (read_csv's na_values): in a text column only an empty cell is missing, where pandas
# read a review that says "NA" (or null, None, nan) as none; a label column keeps them all (NA in a column of ids
# made every id a string, and the classes renumbered in text order)
PANDAS_NA = ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
             "NA", "NULL", "NaN", "None", "n/a", "nan", "null"]
# a TSV: a CSV of tabs without quoting (GLUE's files: a text may hold a lone '"')
DIALECTS = {".csv": {}, ".tsv": {"sep": "\t", "quoting": csv.QUOTE_NONE}}


def load_file_rows(path: str, fields: list[str], key: str = "data.path", texts: list[str] | None = None
                   ) -> list[dict[str, Any]]:
    """Rows of a local CSV, TSV, JSON Lines or Parquet file, read with the `datasets` library. `texts`: the columns of
    `fields` that hold text (None: all), whose cell NA is that text."""
    from datasets import disable_progress_bars, load_dataset  # here: a slow import the embedded default never needs
    from datasets.exceptions import DatasetGenerationError

    disable_progress_bars()  # every rank drew "Generating train split" bars over the run's own lines

    file = Path(path)
    formats = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
    if not file.is_file():
        raise DataError(f"{key}={path} does not exist; give a CSV, TSV, JSONL or Parquet file")
    if file.suffix not in formats:
        raise DataError(f"{key}={path} has suffix {file.suffix!r}; use one of {sorted(formats)}")
    if _blank(file):  # datasets: StopIteration (JSONL) or DatasetGenerationError (CSV)
        raise no_rows(key, path)
    try:
        texts = fields if texts is None else texts
        missing_cells = {field: [""] if field in texts else PANDAS_NA for field in fields}
        tabular = {**DIALECTS[file.suffix], "keep_default_na": False, "na_values": missing_cells} \
            if file.suffix in DIALECTS else {}
        rows = load_dataset(formats[file.suffix], data_files=str(file), split="train", **tabular).to_list()
    except UnicodeDecodeError as err:  # JSON Lines: pyarrow keeps the bytes, to_list decodes them (a ValueError)
        raise not_utf8(key, path, err) from err
    except ValueError as err:  # a CSV header only: 'Instruction "train" corresponds to no data!', even for eval
        if "corresponds to no data" not in str(err):
            raise
        rows = []
    except DatasetGenerationError as err:  # a line that is no JSON in a file too big for the launcher to scan
        if isinstance(err.__cause__, UnicodeDecodeError):
            raise not_utf8(key, path, err.__cause__) from err
        raise DataError(f"{key}={path} does not read as {formats[file.suffix]}: {err.__cause__ or err}") from err
    if not rows:
        raise no_rows(key, path)
    _check_columns(rows, fields, str(file), "data.text_fields/data.label_field")
    return rows


def text_file_rows(path: str, field: str, key: str) -> list[dict[str, Any]]:
    """Masked-LM text. Plain .txt: one sample per non-empty line; other suffixes go through load_file_rows."""
    if not path.endswith(".txt"):
        rows = load_file_rows(path, [field], key=key)
    elif not Path(path).is_file():
        raise DataError(f"{key}={path} does not exist; give a .txt, CSV, TSV, JSONL or Parquet file")
    else:
        try:
            lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # (no BOM in the first sample)
            rows = [{field: line} for line in lines if line.strip()]
        except UnicodeDecodeError as err:
            raise not_utf8(key, path, err) from err
    if not rows:  # blank lines only
        raise no_rows(key, path)
    check_text(rows, [field], f"{key}={path}", "data.text_field")
    return rows


def load_hub_rows(name: str, subset: str | None, split: str, fields: list[str]) -> list[dict[str, Any]]:
    """Rows of a hub dataset split, e.g. name=nyu-mll/glue subset=mrpc (needs the hub or its cache)."""
    from datasets import load_dataset

    try:
        rows = load_dataset(name, subset, split=split).to_list()
    except Exception as err:  # offline, unknown name, ...: one clear line
        raise DataError(f"data.name={name} data.task={subset} could not be loaded ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200]}); it needs the hub or a local copy "
                         f"(data=files data.path=...)") from None
    _check_columns(rows, fields, f"{name}/{subset}", "data.text_fields/data.label_field")
    return rows


# GLUE tasks and their text columns, so `data=glue data.task=mrpc` needs nothing else.
GLUE_FIELDS = {"mrpc": ["sentence1", "sentence2"], "sst2": ["sentence"], "cola": ["sentence"],
               "rte": ["sentence1", "sentence2"], "qnli": ["question", "sentence"],
               "qqp": ["question1", "question2"], "wnli": ["sentence1", "sentence2"],
               "stsb": ["sentence1", "sentence2"]}
