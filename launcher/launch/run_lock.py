"""One launch at a time in a run dir: the parent holds an exclusive lock on <run_dir>/launch.lock from its first
check until its workers end (launcher=local) or its job is queued (launcher=slurm; the job's first node then holds
it while the job runs, launcher/launch/slurm.py). A second `python -m launcher`
into that run dir (another terminal, a sweep's command again) then starts nothing instead of training beside the
first from the same checkpoint. The kernel drops the lock with the process however it ends, so a crash leaves no
stale lock. Exercised by: tests/test_run_lock.py.
"""
from __future__ import annotations

import fcntl
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Iterator

LOCK_FILE = "launch.lock"  # who holds it: {"pid", "host", "since"}; the lock itself is the kernel's (flock)
TRIES = 5  # a status probe holds the lock for microseconds: a launch at that instant tries again


def _who(fd: int) -> str:
    """The holder's record as words; "another launch" while it has locked the file but not written it yet."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {record['pid']} on {record['host']} since {record['since']}"
    except (ValueError, TypeError, KeyError):
        return "another launch"


@contextmanager
def launch_lock(run_dir: Path) -> Iterator[str | None]:
    """Inside, this process holds the run dir's lock and None is given; when another process holds it, who that
    is ("pid N on HOST since TIME"), and nothing is held."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # The file stays after the launch: unlinking a lock file lets two later launches lock two different files
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for attempt in range(TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == TRIES - 1:
                    yield _who(fd)
                    return
                time.sleep(0.05)
            except OSError as err:  # e.g. Lustre mounted without -o flock: ENOSYS
                print(f"note: {run_dir} is on a file system without flock ({err.strerror}): a second launch into it "
                      f"while this one runs would not be stopped", file=sys.stderr, flush=True)
                yield None
                return
        record = {"pid": os.getpid(), "host": platform.node(), "since": datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield None
    finally:
        os.close(fd)  # releases the lock


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run dir's lock now (a launch whose workers run), None when nobody does."""
    if not (run_dir / LOCK_FILE).is_file():
        return None
    fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once by the close below
        return None
    except BlockingIOError:
        return _who(fd)
    except OSError:  # no flock on this file system: nobody can hold it
        return None
    finally:
        os.close(fd)
