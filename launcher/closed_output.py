"""Training goes on when what reads its output goes away (`python -m launcher ... | head`, a log shipper that died).

Python raises BrokenPipeError at the next print to a pipe nobody reads: rank 0's next log line ended the run there,
and the launcher's next line the launch. Where stdout or stderr breaks, what follows on it goes nowhere instead; the
run dir keeps every line (launcher.log, metrics.jsonl, the trackers). Exercised by: tests/test_failures_on_record.py.
"""
from __future__ import annotations

import os
import sys
from typing import IO


class Unbroken:
    """A text stream whose writes go on to /dev/null once its reader is gone."""

    def __init__(self, stream: IO[str]):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        # the file descriptor itself: its buffered text, C code's writes and processes started later go there too
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)

    def __getattr__(self, name: str):  # isatty, fileno, encoding: the stream's
        return getattr(self._stream, name)


def output_may_close() -> None:
    """stdout and stderr survive their reader; first thing in a process, before anything keeps a reference to them."""
    if not isinstance(sys.stdout, Unbroken):
        sys.stdout, sys.stderr = Unbroken(sys.stdout), Unbroken(sys.stderr)
