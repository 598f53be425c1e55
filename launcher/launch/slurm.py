"""Slurm's side of a job: what each node's task runs (torchrun's agent for that node's workers), and its requeue.
launcher/launch/slurm_submit.py submits the runs; launcher/launch/slurm_jobs.py reads the jobs' states.

Exercised by: `python -m launcher +exp=toy launcher=slurm` and tests/test_slurm.py (a real cluster).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import submitit
from omegaconf import OmegaConf

from launcher.launch.environment import record_slurm_job
from launcher.launch.local import c10d_rendezvous, run_agent
from launcher.launch.plan import Plan
from launcher.launch.run_lock import launch_lock
from launcher.launch.run_log import kept_in
from launcher.launch.workers_address import workers_address
from launcher.preempt import OUT_OF_MEMORY_EXIT_CODE, PREEMPTED_FILE, REQUEUE_EXIT_CODE, read_preempted
from launcher.train.phases import LAUNCH_TIME

REQUEUES_FILE = "requeues.json"  # how often the job requeued itself (preempted, out of memory); launcher.max_requeues
def rendezvous_port(job_id: str, restart: int) -> int:
    """A port per job and per requeue, so that jobs sharing a node do not clash (no fixed 29500): a hash of the
    whole id (its digits alone made array tasks 1_23 and 12_3 one port), below Linux's ephemeral range
    (32768 on), whose outgoing connections could hold it."""
    digest = hashlib.sha256(f"{job_id}-{restart}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 12768


class NodeTask(submitit.helpers.Checkpointable):
    """What each node's Slurm task runs: torchrun's agent, rendezvous at the first node's address."""

    def __init__(self, config_path: str):
        self.config_path = config_path

    def __call__(self) -> int:
        config_path = Path(self.config_path)
        run_dir, cfg = config_path.parent, OmegaConf.load(config_path)
        env = submitit.JobEnvironment()
        restart = int(os.environ.get("SLURM_RESTART_COUNT", 0))
        if restart:  # submitit counts a task done once its result file is there: an earlier attempt's error
            # (this node's ranks failed when another node's ran out of memory) would read as this attempt's
            env.paths.result_pickle.unlink(missing_ok=True)
        # The job holds its run dir's lock as a local launch does (the first node, for all): a launch that got past
        # slurm.json (its sacct and squeue had no answer) starts nothing while the job runs, nor the job while it does
        # launcher.log keeps the first node's lines as a local launch's: a failed start's error line too (one node:
        # appends of several hosts to one file on shared storage may cut into each other)
        first = env.global_rank == 0
        with kept_in(run_dir) if first else nullcontext(), launch_lock(run_dir) if first else nullcontext() as holder:
            if holder:
                raise RuntimeError(f"run dir {run_dir}: a launch ({holder}) runs there; job {env.job_id} starts nothing "
                                   f"(stop that launch, then resubmit with hydra.run.dir={run_dir})")
            if first:
                (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)  # from the attempt before a requeue
                record_slurm_job(run_dir)  # job id, node list, requeue count: for a bug report
            # The first node's address, not its name: names need not resolve (emulated nodes, some clusters). Its
            # task (global rank 0: Slurm starts a step's task 0 on the first node, where the batch script runs and
            # srun was called from) serves the store there: torch's own guess fails on many nodes (c10d_rendezvous).
            host = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or env.hostnames[0]
            endpoint = f"{host}:{rendezvous_port(env.job_id, restart)}"
            rendezvous = c10d_rendezvous(endpoint, f"{env.job_id}-{restart}", cfg.launcher.rdzv_timeout_s,
                                         hosts=first, workers_at=workers_address(endpoint))
            os.environ[LAUNCH_TIME] = str(time.time())  # (sbatch copied the submit host's: not the queue's time)
            code = run_agent(config_path, Plan(**cfg.plan), cfg.launcher, rendezvous)
        if code in (REQUEUE_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE):
            # After the agent, SIGTERM has submitit's handler again, which ignores it: the SIGTERM of Slurm's
            # requeue would wait for the SIGKILL. With the default action the task just ends and is requeued.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if code == OUT_OF_MEMORY_EXIT_CODE:
                # train.micro_batch_size=auto ran out where a step cannot be redone, and micro_batch.json
                # holds half the size: the next start resumes with it. A node whose rank ran out requeues (the
                # other nodes' ranks fail in a collective), once per attempt when several did (in eval, alike).
                if first_to_requeue(env.paths.folder, env.job_id, restart):
                    requeue(run_dir, env.job_id, cfg.launcher.max_requeues, "ran out of memory")
            # launcher.signal is Slurm's warning before the time limit: requeue ourselves. SIGTERM comes
            # from Slurm's own requeue, a cancel, or the limit itself, SIGINT from a person: Slurm decides.
            elif env.global_rank == 0 and read_preempted(run_dir)["signal"] not in (signal.SIGTERM, signal.SIGINT):
                requeue(run_dir, env.job_id, cfg.launcher.max_requeues, "preempted")
            # No result file: the requeued job, not this attempt, reports the outcome.
            raise SystemExit(REQUEUE_EXIT_CODE)
        if code:
            raise RuntimeError(f"node {env.node} of job {env.job_id} failed with exit code {code}; see {run_dir}")
        return 0


def first_to_requeue(folder: Path, job_id: str, restart: int) -> bool:
    """Whether this node is the first to claim the requeue of this attempt: an exclusive create, atomic on the
    shared storage of a cluster too (NFS included), in the job's submitit folder."""
    try:
        os.close(os.open(folder / f"{job_id}_requeue_{restart}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def requeue(run_dir: Path, job_id: str, max_requeues: int, why: str) -> None:
    """Put the job (the same array task) back in the queue; it resumes in the same run dir."""
    count = requeues_so_far(run_dir, job_id)
    if count >= max_requeues:
        raise RuntimeError(f"{why} after {count} requeues (launcher.max_requeues={max_requeues}); the checkpoint "
                           f"is kept: resubmit with hydra.run.dir={run_dir}")
    # counted first: Slurm's requeue sends this task the SIGTERM that ends it
    (run_dir / REQUEUES_FILE).write_text(json.dumps({"job_id": job_id, "count": count + 1}) + "\n")
    print(f"requeued: {why}; job {job_id} resumes in {run_dir} (requeue {count + 1} of launcher.max_requeues="
          f"{max_requeues})", file=sys.stderr, flush=True)
    subprocess.check_call(["scontrol", "requeue", job_id], timeout=60)


def requeues_so_far(run_dir: Path, job_id: str) -> int:
    """How often this job requeued itself: launcher.max_requeues counts per submitted job (a resubmission of the
    run dir starts at 0; it could otherwise never requeue again)."""
    try:
        record = json.loads((run_dir / REQUEUES_FILE).read_text())
    except (OSError, ValueError):
        return 0
    return record["count"] if record.get("job_id") == job_id else 0


