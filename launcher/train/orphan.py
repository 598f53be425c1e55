"""A worker ends with the launcher process that runs its agent, however that process ends.

torchrun starts each worker in a session of its own, so a launcher killed outright (kill -9, the kernel's
out-of-memory killer, an IDE's stop button) left its workers training. Its run-dir lock went with it, and a
second launch then trained beside them from the same checkpoint, both writing the run dir. A signal the agent
gets is another matter: it relays that one, and the workers checkpoint (launcher/preempt.py).
Exercised by: tests/test_run_lock.py.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

AGENT_PID = "LAUNCHER_AGENT_PID"  # set by the launcher for the workers of its agent (launcher/launch/local.py)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_the_agent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent, the launcher's agent, ends. Elsewhere, or
    under a torchrun that the launcher did not start, nothing changes."""
    agent = os.environ.get(AGENT_PID)
    if agent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        print(f"warning: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(ctypes.get_errno())}): this worker would "
              f"outlive a launcher killed outright", file=sys.stderr, flush=True)
        return
    if os.getppid() != int(agent):  # the agent ended before the call above, which then arms nothing
        os.kill(os.getpid(), signal.SIGKILL)
