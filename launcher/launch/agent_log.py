"""torchrun's agent's log lines that the launcher's own line says better, left out of what a launch prints.

When a rank fails, or Ctrl-C stops a run, the agent logs that it sends the other workers SIGTERM, which worker
failed with which exit code and binary, and the signal it received: three to five W/E lines between the rank's
output and the launcher's `error: rank N failed: ...` or `stopped by SIGINT ...` line, which names the rank, its
error and the run dir. Its other lines (restarts, rendezvous, timeouts) stay. Exercised by: tests/test_bad_input.py.
"""
from __future__ import annotations

import logging

AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
SAID_BY_THE_LAUNCHER = ("Sending process %s closing signal", "failed (exitcode: %s) local_rank",
                        "Received %s death signal")


class SaidByTheLauncher(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(SAID_BY_THE_LAUNCHER))


def leave_out_what_the_launcher_says() -> None:
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, SaidByTheLauncher) for f in logger.filters):  # (each point of a local sweep)
            logger.addFilter(SaidByTheLauncher())
