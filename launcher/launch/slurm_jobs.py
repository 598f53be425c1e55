"""What Slurm says of a run dir's jobs (sacct, squeue): their states, and whether one still runs there.

Apart from launcher/launch/slurm.py (the node's task, which imports torch's agent), so that `python -m
launcher.launch.status` starts in a fraction of a second. Exercised by: tests/test_slurm.py.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

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


def ended_states(job_ids: list[str], timeout_s: float = 30) -> dict[str, str]:
    """The states Slurm gives jobs whose tasks have ended: submitit sees a task's result (or its error) before the
    task's process, the epilog and accounting end, so sacct says RUNNING for a few seconds more. One query of all
    the jobs a second, for at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    states = slurm_states(job_ids)
    while ACTIVE & set(states.values()) and time.monotonic() < deadline:
        time.sleep(1)
        states = slurm_states(job_ids)
    return states


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


def dependency_problem(job_ids: list[str], kind: str) -> str | None:
    """Why a dependency on these jobs would not wait as asked, or None: a job Slurm knows nothing of (sbatch takes it,
    and the job runs at once), or, for afterok, one that ended otherwise than COMPLETED (never met: Slurm cancels the
    job, or, once it forgot the other, runs it at once); for afternotok, one that COMPLETED. Told only where Slurm
    answered: without accounting (no sacct) or a controller, it is left to Slurm."""
    try:
        out = subprocess.run(["sacct", "-a", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                             capture_output=True, text=True, timeout=30)  # (-a: a colleague's job too)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rows = [(row, state.split()[0]) for row, _, state in (line.partition("|") for line in out.stdout.splitlines())
            if state.strip()]
    for job in job_ids:
        # an array's id names its tasks (7_0, 7_1; 7_[2-5%2] while some wait), a task's id its row or that one
        mine = [state for row, state in rows if row == job or row.startswith(f"{job}_")
                or ("_" in job and row.startswith(job.split("_")[0] + "_["))]
        if not mine and _unknown_to_the_controller(job):  # (a job submitted a moment ago: not in accounting yet)
            return f"Slurm knows no job {job} (sacct, scontrol show job)"
        ended = sorted({state for state in mine if state not in ACTIVE | {"COMPLETED"}})
        if kind == "afterok" and ended:
            return f"job {job} ended {'/'.join(ended)}, so afterok can never be met"
        if kind == "afternotok" and mine and set(mine) == {"COMPLETED"}:
            return f"job {job} COMPLETED, so afternotok can never be met"
    return None


def _unknown_to_the_controller(job_id: str) -> bool:
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode != 0 and "Invalid job id" in out.stderr
