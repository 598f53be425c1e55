"""Slurm's side of a job: what each node's task runs (torchrun's agent for that node's workers), its requeue,
and the jobs' states. launcher/launch/slurm_submit.py submits the runs.

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
from launcher.preempt import OUT_OF_MEMORY_EXIT_CODE, PREEMPTED_FILE, REQUEUE_EXIT_CODE, read_preempted
from launcher.train.phases import LAUNCH_TIME

REQUEUES_FILE = "requeues.json"  # how often the job requeued itself (preempted, out of memory); launcher.max_requeues
JOB_FILE = "slurm.json"  # the job id and log dir, for `python -m launcher.launch.status`
# A job in these states still runs in its run dir, or will: a second one there would train beside it
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED"}


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """Each job's state from accounting (sacct), else from the queue (squeue), UNKNOWN where neither knows it.
    One call of each for all the jobs: Slurm asks programs not to call sacct in a loop (it loads slurmdbd), and
    a `status` of a 100-point sweep would wait for 100 of them (18 s each when the controller is down)."""
    states: dict[str, str] = {}
    # sacct has no row for a pending array task (its array's row reads 7_[2-5%2]); squeue -r lists each task
    for cmd in (["sacct", "-n", "-X", "-P", "-o", "JobID,State"], ["squeue", "-r", "-h", "-o", "%i|%T"]):
        missing = {job: None for job in job_ids if job not in states}
        if not missing:
            break
        try:
            out = subprocess.run([*cmd, "-j", ",".join(missing)], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for job, _, state in (line.partition("|") for line in out.splitlines()):
            if job in missing and job not in states and state.strip():
                states[job] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return {job: states.get(job, "UNKNOWN") for job in job_ids}


def slurm_state(job_id: str) -> str:
    return slurm_states([job_id])[job_id]


def ended_state(job_id: str, timeout_s: float = 30) -> str:
    """The state Slurm gives a job whose task has ended: submitit sees the task's result (or its error) before the
    task's process, the epilog and accounting end, so sacct says RUNNING for a few seconds more."""
    deadline = time.monotonic() + timeout_s
    while (state := slurm_state(job_id)) in ACTIVE and time.monotonic() < deadline:
        time.sleep(1)
    return state


def recorded_job(run_dir: Path) -> str | None:
    """The id of the run dir's Slurm job, from its slurm.json (None: the run was never submitted)."""
    record = run_dir / JOB_FILE
    return json.loads(record.read_text())["job_id"] if record.is_file() else None


def active_job(run_dir: Path) -> str | None:
    """"job <id> is <state>" when the run dir's Slurm job has not ended (None: none, or it ended)."""
    job_id = recorded_job(run_dir)
    if job_id is None:
        return None
    state = slurm_state(job_id)
    return f"job {job_id} is {state}" if state in ACTIVE else None


def job_goes_on(run_dir: Path, active: str) -> str:
    """What a launch into a run dir whose Slurm job has not ended says (active_job's words), and starts nothing."""
    return (f"run dir {run_dir}: its {active}; nothing to start (it resumes there by itself; scancel it first to start "
            f"this command instead)")


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
        # launcher.log keeps each node's lines as a local launch's does: a failed start's error line too
        with kept_in(run_dir), launch_lock(run_dir) if env.global_rank == 0 else nullcontext() as holder:
            if holder:
                raise RuntimeError(f"run dir {run_dir}: a launch ({holder}) runs there; job {env.job_id} starts nothing "
                                   f"(stop that launch, then resubmit with hydra.run.dir={run_dir})")
            if env.global_rank == 0:
                (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)  # from the attempt before a requeue
                record_slurm_job(run_dir)  # job id, node list, requeue count: for a bug report
            # The first node's address, not its name: names need not resolve (emulated nodes, some clusters).
            host = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or env.hostnames[0]
            rendezvous = c10d_rendezvous(f"{host}:{rendezvous_port(env.job_id, restart)}", f"{env.job_id}-{restart}",
                                         cfg.launcher.rdzv_timeout_s)
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


