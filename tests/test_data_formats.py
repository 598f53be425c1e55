"""Data files as users' files come: an encoding other than UTF-8 named by the parent, cells that read NA or null kept
as text, a TSV as GLUE writes it, cells split by another delimiter than the suffix says; in process, with files in
tmp_path."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.bert import TextClassification
from jobs.text import DataError, load_file_rows, text_file_rows
from launcher.derived import ConfigError
from launcher.launch.checks import check_job_inputs

DATA = {"text_fields": ["text"], "label_field": "label", "num_labels": 2}


def check(path: Path, **data: str) -> None:
    check_job_inputs({"model": {}, "data": {**DATA, "path": str(path), **data}}, {})


@pytest.mark.parametrize("name", ["train.csv", "train.jsonl", "corpus.txt"])
def test_a_file_in_latin_1_is_named_by_the_parent_with_its_line_and_the_fix(tmp_path: Path, name: str) -> None:
    """A Latin-1 byte stopped the parent with a UnicodeDecodeError traceback where its read of the columns reached
    it; past that (a .txt, a row beyond the first 8 KiB) each rank failed in pandas' decoder, under datasets'."""
    rows = {"train.csv": "text,label\ngood,pos\ncafé crème,neg\n", "corpus.txt": "a line\n\nun café\n",
            "train.jsonl": '{"text": "good", "label": "pos"}\n{"text": "café", "label": "neg"}\n'}[name]
    path = tmp_path / name
    path.write_bytes(rows.encode("latin-1"))
    line = 3 if name != "train.jsonl" else 2
    column = rows.splitlines()[line - 1].index("é") + 1
    stem, suffix = name.split(".")
    with pytest.raises(ConfigError, match=rf"^data\.path={path} is no UTF-8 text: line {line} holds byte 0xe9 at "
                                          rf"column {column}; save it as UTF-8 \(a Latin-1 file: iconv -f latin1 -t "
                                          rf"utf-8 {name} > {stem}-utf8\.{suffix}\)$"):
        check(path, **({"text_field": "text"} if suffix == "txt" else {}))
    # the job's reader says it in one line (where the file is too big for the parent's scan)
    with pytest.raises(DataError, match=rf"^data\.path={path} is no UTF-8 text \(byte 0xe9\); save it as UTF-8$"):
        (text_file_rows(str(path), "text", "data.path") if suffix == "txt" else
         load_file_rows(str(path), ["text", "label"]))
    header = tmp_path / "header.csv"
    header.write_bytes("texte rédigé,label\ngood,pos\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"header\.csv is no UTF-8 text: line 1 holds byte 0xe9"):
        check(header)
    path.write_bytes(b"\xef\xbb\xbf" + rows.encode())  # UTF-8, with the byte order mark Excel writes: read
    check(path, **({"text_field": "text"} if suffix == "txt" else {}))


def test_cells_that_read_na_or_null_are_texts_and_only_an_empty_cell_is_missing(tmp_path: Path, tiny_bert: Path) -> None:
    """pandas' default read the texts NA, null, None, N/A and nan as empty cells: the parent (Python's csv) let the
    file by, then every rank refused row 1 for having no text."""
    path = tmp_path / "train.csv"
    path.write_text("text,label\nNA,pos\nnull,neg\nNone,pos\nN/A,neg\nnan,pos\ngood,neg\n")
    check(path)
    assert [row["text"] for row in load_file_rows(str(path), ["text", "label"])] == [
        "NA", "null", "None", "N/A", "nan", "good"]
    job = TextClassification(str(tiny_bert), source="files", path=str(path), text_fields=["text"], label_field="label")
    assert len(job.train_set) == 6
    # a label that reads NA is a name like any other; an empty cell is still no label, in the job's words
    path.write_text("text,label\ngood,NA\nbad,neg\nok,\n")
    with pytest.raises(ValueError, match=rf"^data\.path={path} row 3: no label in column 'label'"):
        check(path)


def test_a_tsv_is_read_as_glue_writes_it_and_its_bad_rows_are_named(tmp_path: Path, tiny_bert: Path) -> None:
    """A .tsv was refused by every rank ("has suffix '.tsv'"), after their start-up: GLUE's files are TSVs, whose
    texts hold a lone '"' that no quoting pairs."""
    path = tmp_path / "train.tsv"
    path.write_text('sentence\tlabel\nit \'s a "great film\t1\nawful\t0\nNA\t1\n')
    check(path, text_fields=["sentence"])
    assert [row["sentence"] for row in load_file_rows(str(path), ["sentence", "label"])] == [
        'it \'s a "great film', "awful", "NA"]
    job = TextClassification(str(tiny_bert), source="files", path=str(path), text_fields=["sentence"],
                             label_field="label")
    assert len(job.train_set) == 3
    path.write_text("sentence\tlabel\ngood\t1\nbad\tfilm\t0\n")
    with pytest.raises(ConfigError, match=r"row 2 has 3 cells where the header names 2 columns; a text holds a tab "):
        check(path, text_fields=["sentence"])
    path.write_text("sentence\tlabel\ngood\t1\nbad\t\n")
    with pytest.raises(ConfigError, match=r"row 2: no label in column 'label'"):
        check(path, text_fields=["sentence"])


@pytest.mark.parametrize(("name", "delimiter", "fix"), [
    ("excel.csv", ";", "its cells are split by ';', a .csv file's by ',': save it with ',' between cells"),
    ("tabs.csv", "\t", "its cells are split by tabs: name it tabs.tsv"),
    ("commas.tsv", ",", "its cells are split by ',', a .tsv file's by '\\t': save it with '\\t' between cells")])
def test_cells_split_by_another_delimiter_name_it(tmp_path: Path, name: str, delimiter: str, fix: str) -> None:
    """It read as one column, named after the whole header: "has no column(s) ['text', 'label'] (its columns:
    ['text;label']); set data.text_fields / data.label_field to its columns", which they were."""
    path = tmp_path / name
    path.write_text(f"text{delimiter}label\ngood{delimiter}pos\nbad{delimiter}neg\n")
    with pytest.raises(ConfigError, match=rf"has no column\(s\) \['text', 'label'\] .*\); {re.escape(fix)}$"):
        check(path)


@pytest.mark.parametrize(("header", "overrides", "fix"), [
    ("sentence,label", {}, "set data.text_fields=[sentence]"),  # GLUE's SST-2 column
    ("text,sentiment", {}, "set data.label_field=sentiment"),
    ("premise,hypothesis,label", {"text_fields": ["premise", "claim"]}, "set data.text_fields=[premise,hypothesis]"),
    ("review,stars", {}, "set data.text_fields / data.label_field to its columns"),  # two keys: which is which?
    ("sentence,idx,label", {}, "set data.text_fields / data.label_field to its columns")])  # two columns for one
def test_a_column_the_file_lacks_is_answered_with_the_one_it_has(
        tmp_path: Path, header: str, overrides: dict, fix: str) -> None:
    path = tmp_path / "train.csv"
    path.write_text(f"{header}\n" + ",".join(["good"] * (header.count(",")) + ["1"]) + "\n")
    with pytest.raises(ConfigError, match=rf"\(its columns: \[.*\]\); {re.escape(fix)}$"):
        check(path, **overrides)
