"""Data files as users' files come, in process, with files in tmp_path.

An encoding other than UTF-8 named by the parent, cells that read NA or null kept as text, a TSV as GLUE writes it,
cells split by another delimiter than the suffix says, a column named by the one the file has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.bert import TextClassification
from jobs.text import DataError, load_file_rows, text_file_rows
from launcher.derived import ConfigError
from launcher.launch.checks import check_job_inputs
from launcher.launch.data_files import has_rows

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
    for ending in ("\n", "\r\n", "\r"):  # (a lone \r: a classic Mac file's lines, each of them line 1 before)
        path.write_bytes(rows.replace("\n", ending).encode("latin-1"))
        with pytest.raises(ConfigError, match=rf"^data\.path={path} is no UTF-8 text: line {line} holds byte 0xe9 "
                                              rf"at column {column}; save it as UTF-8 \(a file of Windows' Western "
                                              rf"encoding: iconv -f cp1252 -t utf-8 {name} > {stem}-utf8\.{suffix}\)$"):
            check(path, **({"text_field": "text"} if suffix == "txt" else {}))
    # the job's reader says it in one line (where the file is too big for the parent's scan)
    with pytest.raises(DataError, match=rf"^data\.path={path} is no UTF-8 text \(byte 0xe9\); save it as UTF-8$"):
        (text_file_rows(str(path), "text", "data.path") if suffix == "txt" else
         load_file_rows(str(path), ["text", "label"]))
    path.write_bytes(b"\xef\xbb\xbf" + rows.encode())  # UTF-8, with the byte order mark Excel writes: read
    check(path, **({"text_field": "text"} if suffix == "txt" else {}))
    if suffix == "txt":  # (the mark is no part of the first sample)
        assert text_file_rows(str(path), "text", "data.path")[0] == {"text": "a line"}


def test_where_a_byte_is_no_utf_8_counts_characters_and_utf_16_is_named(tmp_path: Path) -> None:
    """The column is the one an editor shows (it counted bytes: 'naïve' is 6); the byte order mark is no column; a
    UTF-16 file (Excel's "Unicode Text") is said to be one."""
    path = tmp_path / "train.csv"
    path.write_bytes("text,label\nnaïve caf".encode() + b"\xe9,pos\n")
    with pytest.raises(ConfigError, match=r"line 2 holds byte 0xe9 at column 10; "):
        check(path)
    path.write_bytes(b"\xef\xbb\xbf" + "texte rédigé,label\ngood,pos\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"line 1 holds byte 0xe9 at column 8; "):
        check(path)
    path.write_bytes("text,label\ngood,pos\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=rf"^data\.path={path} is UTF-16 text; save it as UTF-8 \(iconv -f utf-16 "
                                          r"-t utf-8 train\.csv > train-utf8\.csv\)$"):
        check(path)
    # UTF-32's mark starts as UTF-16's; without a mark, UTF-16's NUL bytes are valid UTF-8
    for encoding, said in [("utf-32", "UTF-32 text; save it as UTF-8 (iconv -f utf-32"),
                           ("utf-16-le", "UTF-16 (or UTF-32) text; save it as UTF-8 (iconv -f utf-16")]:
        path.write_bytes("text,label\ngood,pos\n".encode(encoding))
        with pytest.raises(ConfigError, match=re.escape(f"is {said}")):
            check(path)


def test_cells_that_read_na_or_null_are_texts_and_only_an_empty_cell_is_missing(
        tmp_path: Path, tiny_bert: Path) -> None:
    """pandas' default read the texts NA, null, None, N/A and nan as empty cells: the parent (Python's csv) let the
    file by, then every rank refused row 1 for having no text."""
    path = tmp_path / "train.csv"
    path.write_text("text,label\nNA,pos\nnull,neg\nNone,pos\nN/A,neg\nnan,pos\ngood,neg\n")
    check(path)
    assert [row["text"] for row in load_file_rows(str(path), ["text", "label"])] == [
        "NA", "null", "None", "N/A", "nan", "good"]
    job = TextClassification(str(tiny_bert), source="files", path=str(path), text_fields=["text"], label_field="label")
    assert len(job.train_set) == 6
    # in a label column, NA is as pandas reads it: no label (a string of it made every id a name: classes
    # renumbered in text order, '10' before '2'), in the parent and in the job
    for labels in ("pos,NA,neg", "1,NA,0", "1,,0"):
        rows = zip(["good", "bad", "ok"], labels.split(","))
        path.write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))
        with pytest.raises(ValueError, match=rf"^data\.path={path} row 2: no label in column 'label'"):
            check(path)
        with pytest.raises(ValueError, match=rf"^data\.path={path} row 2: no label in column 'label'"):
            TextClassification(str(tiny_bert), source="files", path=str(path), text_fields=["text"],
                               label_field="label")


def test_a_line_of_only_spaces_is_skipped_as_pandas_skips_it(tmp_path: Path) -> None:
    """The parent read it as a row without text (pandas skips it): refused, and later rows numbered one off."""
    path = tmp_path / "train.tsv"
    path.write_text("text\tlabel\ngood\t1\n   \nbad\t0\n\t1\n")
    with pytest.raises(ConfigError, match=r"row 3: no text in column 'text'"):
        check(path)
    assert len(load_file_rows(str(path), ["text", "label"])) == 3
    # a name twice: pandas reads the first as it (the second as text.1), and so does the parent
    path.write_text("text\tlabel\ttext\ngood\t1\t\n")
    check(path)
    assert load_file_rows(str(path), ["text", "label"])[0]["text"] == "good"


# lines each reader of a CSV / TSV may skip or read (jobs/text.py's pandas, the parent's csv: DIALECTS in each)
UNLIKE_LINES = {".csv": ["", " \t ", '""', '"two\nlines",neg', " ,neg", 'says ""hi"",neg', '"a, b",neg'],
                ".tsv": ["", " ", "\t", '"q\tneg', 'says "hi\tpos', '""\tneg']}


@pytest.mark.parametrize("suffix", list(UNLIKE_LINES))
def test_the_parent_numbers_rows_as_the_job_s_reader_reads_them(tmp_path: Path, suffix: str) -> None:
    """A line one reader skipped and the other read moved every later row's number, or hid an empty text (the parent
    skipped a line `""` as blank)."""
    sep = {".csv": ",", ".tsv": "\t"}[suffix]
    path = tmp_path / f"train{suffix}"
    for line in UNLIKE_LINES[suffix]:
        path.write_text(f"text{sep}label\ngood{sep}pos\n{line}\nbad{sep}neg\n{sep}pos\n")
        rows = load_file_rows(str(path), ["text", "label"], texts=["text"])
        empty = next(number for number, row in enumerate(rows, 1) if not (row["text"] or "").strip())
        with pytest.raises(ConfigError, match=rf"row {empty}: no text in column 'text'"):
            check(path)


def test_a_quote_that_nothing_closes_is_named_by_its_line(tmp_path: Path) -> None:
    """Python's csv read the rest of the file into that cell and the parent let it by; pandas stops ("EOF inside
    string"), on every rank."""
    path = tmp_path / "train.csv"
    path.write_text('text,label\ngood,pos\n"two\nlines",neg\n"bad,neg\nfine,pos\n')
    with pytest.raises(DataError, match=r"does not read as csv: .*EOF inside string"):
        load_file_rows(str(path), ["text", "label"])
    with pytest.raises(ConfigError, match=rf"^data\.path={path} does not read as CSV \(line 5 opens a quoted cell that "
                                          r"no '\"' closes: close it, or write a '\"' inside a quoted text as two\)$"):
        check(path)
    path.write_text('text,"label\ngood,pos\n')  # in the header: a file with rows (its check of cells names it)
    assert has_rows(path)
    path.write_text('text,label\ngood,pos\n"a ""quoted"" word",neg\nsays "hi,pos\n"x"y,neg')  # pandas reads these
    assert len(load_file_rows(str(path), ["text", "label"])) == 4
    check(path)


def test_a_label_column_among_the_texts_is_refused(tmp_path: Path) -> None:
    """The model would read its label: an eval accuracy of 1.0 that means nothing (the job and the parent also read
    its NA differently: text, no label)."""
    path = tmp_path / "train.csv"
    path.write_text("text,label\ngood,1\n")
    with pytest.raises(ConfigError, match=r"^data\.label_field=label is one of data\.text_fields=\['text', 'label'\]"):
        check(path, text_fields=["text", "label"])


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
    ("commas.tsv", ",", "its cells are split by commas: name it commas.csv")])
def test_cells_split_by_another_delimiter_name_it(tmp_path: Path, name: str, delimiter: str, fix: str) -> None:
    """It read as one column, named after the whole header: "has no column(s) ['text', 'label'] (its columns:
    ['text;label']); set data.text_fields / data.label_field to its columns", which they were."""
    path = tmp_path / name
    path.write_text(f"text{delimiter}label\ngood{delimiter}pos\nbad{delimiter}neg\n")
    with pytest.raises(ConfigError, match=rf"has no column\(s\) \['text', 'label'\] .*\); {re.escape(fix)}$"):
        check(path)


def test_an_eval_file_whose_columns_are_not_the_train_file_s_is_told_to_follow_it(tmp_path: Path) -> None:
    """The override for the eval file (data.text_fields=[sentence]) would have broken the train file."""
    (tmp_path / "train.csv").write_text("text,label\ngood,1\n")
    (tmp_path / "dev.csv").write_text("sentence,label\ngood,1\n")
    with pytest.raises(ConfigError, match=r"^data\.eval_path=.*dev\.csv has no column\(s\) \['text'\] \(its columns: "
                                          r"\['sentence', 'label'\]\); rename its column\(s\) as in data\.path$"):
        check(tmp_path / "train.csv", eval_path=str(tmp_path / "dev.csv"))


@pytest.mark.parametrize(("header", "overrides", "fix"), [
    ("sentence,label", {}, "set data.text_fields=[sentence]"),  # GLUE's SST-2 column
    ("text,sentiment", {}, "set data.label_field=sentiment"),
    ("premise,hypothesis,label", {"text_fields": ["premise", "claim"]}, "set data.text_fields=[premise,hypothesis]"),
    ("review,stars", {}, "set data.text_fields / data.label_field to its columns"),  # two keys: which is which?
    ("sentence,idx,label", {}, "set data.text_fields / data.label_field to its columns"),  # two columns for one
    ("my text,label", {}, "set data.text_fields / data.label_field to its columns"),  # (no one shell argument)
    # no name the config wants between its ';': a column's own name, not a file split by ';'
    ("text;notes", {"text_fields": ["review"]}, "set data.text_fields / data.label_field to its columns")])
def test_a_column_the_file_lacks_is_answered_with_the_one_it_has(
        tmp_path: Path, header: str, overrides: dict, fix: str) -> None:
    path = tmp_path / "train.csv"
    path.write_text(f"{header}\n" + ",".join(["good"] * (header.count(",")) + ["1"]) + "\n")
    with pytest.raises(ConfigError, match=rf"\(its columns: \[.*\]\); {re.escape(fix)}$"):
        check(path, **overrides)
