"""torchrun's agent's log lines that the launcher's own line says better, left out of what a launch prints.

When a rank fails, or Ctrl-C stops a run, the agent logs that it sends the other workers SIGTERM, which worker
failed with which exit code and binary, and the signal it received: three to five W/E lines between the rank's
output and the launcher's `error: rank N failed: ...` or `stopped by SIGINT ...` line, which names the rank, its
error and the run dir. Its other lines stay, and all of them where the agent restarts workers (launcher.max_restarts):
there they are the record of each restart. Exercised by: tests/test_bad_input_in_the_workers.py.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
SAID_BY_THE_LAUNCHER = ("Sending process %s closing signal", "failed (exitcode: %s) local_rank",
                        "Received %s death signal")


class SaidByTheLauncher(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(SAID_BY_THE_LAUNCHER))


@contextmanager
def left_out_when_said(once: bool) -> Iterator[None]:
    """While torchrun's agent runs; `once`: launcher.max_restarts=0, where the launcher's line is the run's end. With
    restarts, the agent's lines are the only record of each worker that died and was restarted: they stay."""
    loggers, said = [logging.getLogger(name) for name in AGENT_LOGGERS], SaidByTheLauncher()
    for logger in loggers if once else []:
        logger.addFilter(said)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(said)
