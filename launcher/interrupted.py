"""Ctrl-C while a process starts (its imports of torch take seconds) ends it in one line, not a traceback of them.

A launch's parent and its workers keep a stop signal only once their own handlers are in place (launcher/preempt.py);
before that, Ctrl-C raised KeyboardInterrupt in whatever torch module was being imported: a screen of tracebacks,
two workers' interleaved. Python still exits as Ctrl-C ends a process (by SIGINT: 130 in a shell), after its exit
handlers. Exercised by: tests/test_stop_signals.py.
"""
from __future__ import annotations

import sys
from types import TracebackType

SAID: list[str | None] = [None]  # the line an uncaught Ctrl-C prints now (None: nothing)


def quiet_ctrl_c(line: str | None) -> None:
    """An uncaught KeyboardInterrupt prints `line` (None: nothing; the launcher says what stopped), not a traceback."""
    SAID[0] = line
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, error, tb)
        elif SAID[0]:
            print(SAID[0], file=sys.stderr, flush=True)

    sys.excepthook = hook


def say_on_ctrl_c(line: str | None) -> None:
    """What an uncaught Ctrl-C says from now on (once workers ran, no longer that none started)."""
    SAID[0] = line
