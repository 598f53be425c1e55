"""Ctrl-C while a process starts (its imports of torch take seconds) ends it in one line, not a traceback of them.

A launch's parent and its workers keep a stop signal only once their own handlers are in place (launcher/preempt.py);
before that, Ctrl-C raised KeyboardInterrupt in whatever torch module was being imported: a screen of tracebacks,
two workers' interleaved. Exercised by: tests/test_stop_signals.py.
"""
from __future__ import annotations

import os
import signal
import sys
from types import TracebackType


def quiet_ctrl_c(line: str | None) -> None:
    """An uncaught KeyboardInterrupt prints `line` (None: nothing; the launcher says what stopped) and ends the
    process as Ctrl-C does: by SIGINT, which its parent (a shell, torchrun's agent) reads as such (130)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, error, tb)
            return
        if line:
            print(line, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)

    sys.excepthook = hook
