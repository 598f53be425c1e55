"""What the parent reads of a job's local data files before any worker starts, each finding named by its line or row.

Their encoding (UTF-8), columns, whether they hold a sample, and the first bad row (a line that is no JSON, an empty
text). Exercised by: tests/test_own_data.py, tests/test_bad_input.py, tests/test_data_formats.py.
"""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any, Iterator

# a TSV is a CSV of tabs without quoting (GLUE's files: a text may hold a lone '"'), as the jobs read it
DIALECTS = {".csv": {}, ".tsv": {"delimiter": "\t", "quoting": csv.QUOTE_NONE}}
# byte order marks of the wide encodings (UTF-32's first: UTF-16 LE's is its prefix); Excel's "Unicode Text" is UTF-16
WIDE_MARKS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))
MAX_SCANNED_BYTES = 256 << 20  # data files the parent reads whole for empty cells, labels (larger: the job finds them)
# pandas reads cells of any length; Python's csv stops at 128 KiB (a long document in a CSV is no error)
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


def not_utf8(path: Path) -> str | None:
    """Where a text data file (CSV, TSV, JSON Lines, JSON, .txt) first holds bytes that are no UTF-8, the only encoding
    the jobs' readers take (a Latin-1 file stopped the parent in a traceback, or each rank in pandas' decoder);
    files are read up to MAX_SCANNED_BYTES."""
    if path.suffix not in (*DIALECTS, ".jsonl", ".json", ".txt"):
        return None
    convert = f"{path.name} > {path.stem}-utf8{path.suffix}"
    read = 0
    with open(path, "rb") as f:  # (by line: 0x0a and 0x0d are never part of a multi-byte UTF-8 character)
        # numbered as an editor numbers them: a line ends at \n, \r\n or a lone \r (a classic Mac file's)
        for number, line in enumerate((line for chunk in f for line in chunk.splitlines(keepends=True)), 1):
            wide = next((name for mark, name in WIDE_MARKS if number == 1 and line.startswith(mark)), None)
            if wide or b"\x00" in line:  # (without its mark, UTF-16's NUL bytes are valid UTF-8: NUL, in each text)
                return (f"is {wide or 'UTF-16 (or UTF-32)'} text; save it as UTF-8 "
                        f"(iconv -f {(wide or 'utf-16').lower()} -t utf-8 {convert})")
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:  # the column in characters, as an editor counts (a BOM is none)
                column = len(line[:err.start].decode("utf-8-sig" if number == 1 else "utf-8")) + 1
                return (f"is no UTF-8 text: line {number} holds byte {line[err.start]:#04x} at column {column}; save "
                        f"it as UTF-8 (a file of Windows' Western encoding: iconv -f cp1252 -t utf-8 {convert})")
            read += len(line)
            if read > MAX_SCANNED_BYTES:
                break
    return None


def columns_of(path: Path) -> list[str] | None:
    """Column names of a CSV / TSV / JSON Lines / Parquet file (None for other formats)."""
    if path.suffix in DIALECTS:
        with open(path, newline="", encoding="utf-8-sig") as f:  # Excel's BOM is no part of the first name
            return next(_csv_rows(f, path.suffix), [])
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
        try:
            return list(json.loads(first)) if first.strip().startswith("{") else None
        except json.JSONDecodeError:  # one object over several lines (a .json file): its job's reader says
            return None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    return None


def split_by_another(columns: list[str], missing: list[str], path: Path) -> str | None:
    """The fix for a CSV / TSV file whose header reads as one column split by another delimiter, between names the
    config wants (Excel's ';' in much of Europe, a tab in a .csv), else None."""
    ours = DIALECTS.get(path.suffix, {}).get("delimiter", ",")
    split = next((d for d in (";", "\t", ",", "|") if path.suffix in DIALECTS and len(columns) == 1 and d != ours
                  and set(missing) & set(columns[0].split(d))), None)
    renamed = {"\t": ("tabs", ".tsv"), ",": ("commas", ".csv")}  # the other suffix reads it
    if split in renamed:
        return f"its cells are split by {renamed[split][0]}: name it {path.stem}{renamed[split][1]}"
    return split and f"its cells are split by {split!r}, a {path.suffix} file's by {ours!r}: save it with {ours!r} " \
                     f"between cells"


def _csv_rows(f: Any, suffix: str) -> Iterator[list[str]]:
    """The rows of a CSV / TSV file, the header first, without the lines pandas skips: one cell of spaces and tabs,
    unquoted. A line `""` is a row of one empty cell to pandas (the parent skipped it: every later row's number was one
    off, and its empty text went unnamed), so a cell is told blank by its text in the file; a TSV's line of tabs is a
    row of empty cells. A quote no '"' closes: csv.Error after the last row (Python's csv reads the rest of the file
    into its cell, pandas stops: "EOF inside string", on every rank)."""
    text: list[str] = []  # the lines of the record being read (a quoted cell may span several)
    record, start, read = "", 1, 0  # the last record, the line it starts on, the lines before the record being read

    def lines() -> Iterator[str]:
        for line in f:
            text.append(line)
            yield line

    for row in csv.reader(lines(), **DIALECTS[suffix]):
        record, start, read = "".join(text), read + 1, read + len(text)
        text.clear()
        if not (len(row) <= 1 and not record.strip(" \t\r\n")):
            yield row
    try:  # (a strict reader says where a quote is left open: only the last record can be)
        list(csv.reader(io.StringIO(record, newline=""), strict=True, **DIALECTS[suffix]))
    except csv.Error as err:
        if "end of data" in str(err):
            raise csv.Error(f"line {start} opens a quoted cell that no '\"' closes: close it, or write a '\"' "
                            f"inside a quoted text as two") from err


def has_rows(path: Path) -> bool:
    """Whether a data file holds a sample: a row under a CSV's header, a JSON line, a Parquet row, a text line that
    is not blank (a job would fail in its reader with an error that names neither the key nor the file)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows > 0
    if path.suffix not in (*DIALECTS, ".jsonl", ".json", ".txt"):  # a format of its own: only its job can tell
        return path.stat().st_size > 0
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        if path.suffix in DIALECTS:
            rows = _csv_rows(f, path.suffix)
            try:
                return next(rows, None) is not None and next(rows, None) is not None  # one beyond the header
            except csv.Error:  # (a header that opens a quote nothing closes: first_bad_row names its line)
                return True
        return any(line.strip() for line in f)


def first_bad_row(path: Path, fields: list[str]) -> str | None:
    """What is wrong with the first bad sample of a CSV / TSV / JSON Lines file: a JSON line that is no object, a
    row of more cells than its header, or no text in one of `fields` (rows numbered as the jobs number them: from 1,
    after the header); files over MAX_SCANNED_BYTES are left to the job."""
    if path.suffix not in (*DIALECTS, ".jsonl") or path.stat().st_size > MAX_SCANNED_BYTES:
        return None
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        if path.suffix in DIALECTS:
            cells = _csv_rows(f, path.suffix)
            header = next(cells, [])
            # a name twice: pandas reads the first as it, the second as name.1
            rows = enumerate((({h: row[i] for i, h in reversed(list(enumerate(header))) if i < len(row)}, len(row))
                              for row in cells), 1)
        else:
            header, rows = [], enumerate(((row, 0) for row in _json_lines(f)), 1)
        try:
            for number, (row, count) in rows:
                if count > len(header):  # cells beyond the header's (pandas misreads the file)
                    fix = ("a text holds a tab (a TSV quotes none: make it a space), or drop a trailing tab"
                           if path.suffix == ".tsv" else
                           "quote a text that holds a comma (\"bad, really\"), or drop a trailing comma")
                    return f"row {number} has {count} cells where the header names {len(header)} columns; {fix}"
                for field in fields:
                    value = row.get(field)
                    if value is None or not str(value).strip():
                        return f"row {number}: no text in column {field!r}; fill it in or drop the row"
        except _NotAnObject as err:  # datasets would say "JSON parse error ... in row 0" under a long traceback
            return f"line {err.line} is no JSON object ({err.why}); each line of a .jsonl file holds one sample"
        except csv.Error as err:
            return f"does not read as CSV ({err})"
    return None


class _NotAnObject(ValueError):
    def __init__(self, line: int, why: str) -> None:
        super().__init__(why)
        self.line, self.why = line, why


def _json_lines(f: Any) -> Any:
    """The objects of a JSON Lines file, blank lines skipped (as `datasets` skips them). A file whose first line is
    no object may be one JSON document over its lines, which `datasets` reads whole: left to the job."""
    seen_an_object = False
    for line_number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            why = None if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        except json.JSONDecodeError as err:
            why = f"{err.msg}, column {err.colno}"
        if why is None:
            seen_an_object = True
            yield row
        elif not seen_an_object:
            return
        else:
            raise _NotAnObject(line_number, why)
