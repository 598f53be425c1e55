"""Run the workers on this machine through torchrun's elastic agent, inside the parent process.

`--standalone` gives a c10d rendezvous on a free localhost port, so two jobs on one host never clash
on 29500. Exercised by: `python -m launcher +exp=toy launcher.nproc_per_node=2`.
"""
from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.plan import Plan


def torchrun_args(config_path: Path, plan: Plan, max_restarts: int) -> list[str]:
    return ["--standalone", f"--nnodes={plan.nnodes}", f"--nproc-per-node={plan.nproc_per_node}",
            f"--max-restarts={max_restarts}", "--module", "launcher.worker", str(config_path)]


def run_local(config_path: Path, plan: Plan, max_restarts: int) -> int:
    """Start the agent and wait; returns the exit code (0, or the first failed rank's)."""
    try:
        torchrun.run(torchrun.parse_args(torchrun_args(config_path, plan, max_restarts)))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message  # from the worker's error file: a dict, or a plain string
        if isinstance(message, dict):
            message = message.get("message", "")
        reason = str(message).strip().splitlines()[-1] if message else f"exit code {failure.exitcode}"
        print(f"error: rank {rank} failed: {reason} (run dir {config_path.parent})", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
