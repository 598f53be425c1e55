"""What a run dir keeps of what the launcher printed (launcher.log) and of why a start failed (error.txt).

The launcher's lines (its phases, warnings, errors) are copied into <run_dir>/launcher.log as they are printed,
without a terminal's colour codes; rank 0 appends its own (steps, warnings, the final line: launcher/train/metrics.py).
A start that fails writes error.txt: the one line it printed, then the failed rank's traceback; the next start
removes it. `python -m launcher.launch.status` reads both. Exercised by: tests/test_failures_on_record.py.
"""
from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from launcher.rundir import ERROR_FILE, LOG_FILE

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class Tee:
    """A text stream that also appends what it is given, colour codes dropped, to a log file."""

    def __init__(self, stream: IO[str], log: IO[str]):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(ANSI.sub("", text))
        return self._stream.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding: the terminal's
        return getattr(self._stream, name)


@contextmanager
def kept_in(run_dir: Path) -> Iterator[None]:
    """While inside, what this process prints also goes to <run_dir>/launcher.log."""
    with open(run_dir / LOG_FILE, "a", buffering=1) as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(out, log), Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def record_failure(run_dir: Path, line: str, details: str = "") -> None:
    """error.txt: the line the launcher printed for this start's failure, then what explains it. The first one of a
    start stays: on several nodes the others' ranks mostly fail because of it (a collective cut short)."""
    try:
        with open(run_dir / ERROR_FILE, "x") as record:
            record.write(line.rstrip() + "\n" + (f"\n{details.rstrip()}\n" if details.strip() else ""))
    except FileExistsError:
        pass


def forget_failure(run_dir: Path) -> None:
    """A new start: the failure of the one before says nothing about it."""
    (run_dir / ERROR_FILE).unlink(missing_ok=True)


def failure_line(run_dir: Path) -> str | None:
    path = run_dir / ERROR_FILE
    return path.read_text().splitlines()[0] if path.is_file() else None
