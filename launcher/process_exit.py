"""Ending a launcher or worker process without CPython's teardown of torch's modules (1 to 2 s each, every run)."""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """What sys.exit(code) does, less the module teardown: wait for the threads that are no daemons, run the
    exit handlers (logging's, the trackers', torch's own), flush stdout and stderr, then os._exit.

    The teardown frees, one object at a time, memory the OS takes back at once: with torch, dynamo and FSDP
    imported it took 1.1 to 2.2 s of each process here, and a launch waits for its workers' exit and then
    its own (a 1-step toy run: 14 s, 3 of them after its last line). Every file of the run is closed before:
    the checkpoint, metrics, tracker and log writers close in the loop, the process group in the worker."""
    # What the interpreter's exit calls first: the thread pools' exit hooks (MLflow's async logging waits in
    # one), then a join of every thread that is no daemon. Private, and in every CPython this project runs on;
    # where it is gone, the whole slow exit
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is None:
        sys.exit(code)
    shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)
