"""Slurm through submitit: one task per node runs torchrun's agent for that node's workers, and every run
of a Hydra `-m` sweep is submitted together as one job array.

Exercised by: `python -m launcher +exp=toy launcher=slurm` and tests/test_slurm.py (a real cluster).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import submitit
from omegaconf import DictConfig, OmegaConf

from launcher.derived import ConfigError
from launcher.launch.environment import record_slurm_job
from launcher.launch.local import c10d_rendezvous, run_agent, torchrun_args
from launcher.launch.plan import Plan
from launcher.launch.run_lock import launch_lock
from launcher.preempt import (OUT_OF_MEMORY_EXIT_CODE, PREEMPTED_FILE, REQUEUE_EXIT_CODE, read_preempted,
                              signal_named)

REQUEUES_FILE = "requeues.json"  # how often the job requeued itself (preempted, out of memory); launcher.max_requeues
JOB_FILE = "slurm.json"  # the job id and log dir, for `python -m launcher.launch.status`


@dataclass
class Submission:
    run_dir: Path
    config_path: Path
    plan: Plan
    launcher: dict[str, Any]
    sweep_dir: Path | None  # -m: the sweep's dir (its points may be fewer than the sweep's: the finished are not)


QUEUE: list[Submission] = []  # filled by the Hydra task for each run; submitted once Hydra is done
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


def queue(run_dir: Path, config_path: Path, plan: Plan, launcher: DictConfig, sweep_dir: Path | None) -> None:
    QUEUE.append(Submission(run_dir, config_path, plan, OmegaConf.to_container(launcher, enum_to_str=True), sweep_dir))


def rendezvous_port(job_id: str, restart: int) -> int:
    """A port per job and per requeue, so that jobs sharing a node do not clash (no fixed 29500): a hash of the
    whole id (its digits alone made array tasks 1_23 and 12_3 one port), below Linux's ephemeral range
    (32768 on), whose outgoing connections could hold it."""
    digest = hashlib.sha256(f"{job_id}-{restart}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 12768


DEPENDENCY = re.compile(r"^(singleton|(after|afterok|afternotok|afterany|aftercorr|afterburstbuffer)(:\d+(_\d+)?"
                        r"(\+\d+)?)+)([,?](singleton|(after|afterok|afternotok|afterany|aftercorr)(:\d+(_\d+)?(\+\d+)?)+))*$")


def dependency(launcher: dict[str, Any]) -> str | None:
    """sbatch's --dependency from launcher.dependency and launcher.after (the job of that run dir must
    complete first), or ConfigError naming the key."""
    parts = []
    if launcher["dependency"]:
        if not DEPENDENCY.match(launcher["dependency"]):
            raise ConfigError(f"launcher.dependency={launcher['dependency']} is not an sbatch dependency; e.g. "
                              f"afterok:1234, afterany:1234:1235 or singleton")
        parts.append(launcher["dependency"])
    if launcher["after"]:
        job_id = recorded_job(Path(launcher["after"]))
        if job_id is None:
            raise ConfigError(f"launcher.after={launcher['after']} holds no {JOB_FILE}: name the run dir of a run "
                              f"submitted with launcher=slurm")
        parts.append(f"afterok:{job_id}")
    return ",".join(parts) or None


def executor_parameters(launcher: dict[str, Any], plan: Plan, job_name: str) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters: one task per node, which starts the node's workers itself."""
    extra = dict(launcher["additional_parameters"])
    # Requeue=1 whatever the site's default: with JobRequeue=0 a job's `scontrol requeue` of itself (after the
    # preemption warning, or running out of memory) fails, "Requested operation is presently disabled".
    # Slurm then also requeues the job after a node failure; it resumes from the latest checkpoint.
    if extra.get("requeue") is False:  # submitit would write --requeue=False, which sbatch refuses
        del extra["requeue"]
        extra["no_requeue"] = True
    if not {"requeue", "no_requeue", "no-requeue"} & set(extra):  # the user's own choice, either spelling
        extra["requeue"] = True
    after = dependency(launcher)
    if after:  # a job whose dependency can never be met (the first job failed) is cancelled, not left pending
        extra.update({"dependency": after, "kill_on_invalid_dep": "yes"})
    preempt_signal = signal_named(launcher["signal"])
    if preempt_signal != signal.SIGUSR2:  # submitit writes --signal=USR2@delay; another signal replaces it
        extra["signal"] = f"{preempt_signal.name.removeprefix('SIG')}@{launcher['signal_delay_s']}"
    params = {"job_name": job_name, "nodes": plan.nnodes, "ntasks_per_node": 1,
              "cpus_per_task": launcher["cpus_per_task"] or plan.nproc_per_node, "time": launcher["timeout_min"],
              "signal_delay_s": launcher["signal_delay_s"], "array_parallelism": launcher["array_parallelism"],
              "setup": list(launcher["setup"]), "additional_parameters": extra, "stderr_to_stdout": True}
    if launcher["gpus_per_node"]:
        params["gpus_per_node"] = launcher["gpus_per_node"]
    if launcher["mem_gb"]:
        params["mem"] = f"{launcher['mem_gb']}GB"
    if launcher["exclusive"]:
        params["exclusive"] = True
    params.update({key: launcher[key] for key in ("partition", "account", "qos", "constraint") if launcher[key]})
    return params


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
        with launch_lock(run_dir) if env.global_rank == 0 else nullcontext() as holder:
            if holder:
                raise RuntimeError(f"run dir {run_dir}: a launch ({holder}) runs there; job {env.job_id} starts nothing "
                                   f"(stop that launch, then resubmit with hydra.run.dir={run_dir})")
            if env.global_rank == 0:
                (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)  # from the attempt before a requeue
                record_slurm_job(run_dir)  # job id, node list, requeue count: for a bug report
            # The first node's address, not its name: names need not resolve (emulated nodes, some clusters).
            host = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or env.hostnames[0]
            rendezvous = c10d_rendezvous(f"{host}:{rendezvous_port(env.job_id, restart)}", f"{env.job_id}-{restart}")
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
    path = run_dir / REQUEUES_FILE
    count = json.loads(path.read_text())["count"] if path.exists() else 0
    if count >= max_requeues:
        raise RuntimeError(f"{why} after {count} requeues (launcher.max_requeues={max_requeues}); the checkpoint "
                           f"is kept: resubmit with hydra.run.dir={run_dir}")
    path.write_text(json.dumps({"count": count + 1}) + "\n")
    print(f"requeued: {why}; job {job_id} resumes in {run_dir} (requeue {count + 1} of launcher.max_requeues="
          f"{max_requeues})", file=sys.stderr, flush=True)
    subprocess.check_call(["scontrol", "requeue", job_id], timeout=60)


def _same_submission(runs: list[Submission]) -> None:
    """A job array shares one set of executor parameters: every sweep point must agree on them."""
    first = runs[0]
    for run in runs[1:]:
        for key, value in first.launcher.items():
            if run.launcher[key] != value:
                raise ConfigError(f"launcher.{key} differs between sweep points ({value} vs {run.launcher[key]});"
                                  f" one job array needs one value")
        # Accumulation may differ (each task reads its own config.yaml); the job's shape may not
        if replace(run.plan, grad_accum_steps=None) != replace(first.plan, grad_accum_steps=None):
            raise ConfigError("the sweep points need different world sizes or node counts; one job array "
                              "needs one shape (sweep launcher.nodes/gpus_per_node in separate launches)")


def submit_queued() -> int:
    """Submit what the Hydra task queued: one job, or one array for a sweep. Returns the exit code."""
    if not QUEUE:
        return 0
    runs = list(QUEUE)
    QUEUE.clear()
    try:
        _same_submission(runs)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    launcher, plan = runs[0].launcher, runs[0].plan
    common = runs[0].sweep_dir or runs[0].run_dir
    folder = Path(launcher["log_dir"] or common / "slurm")
    params = executor_parameters(launcher, plan, job_name=OmegaConf.load(runs[0].config_path).name)
    if launcher["dry_run"]:
        print_plan(runs, params, folder)
        return 0
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**params)
    with executor.batch():  # several submissions in a batch become one job array
        jobs = [executor.submit(NodeTask(str(run.config_path))) for run in runs]
    for job, run in zip(jobs, runs):
        (run.run_dir / JOB_FILE).write_text(json.dumps({"job_id": job.job_id, "log_dir": str(folder)}) + "\n")
        print(f"submitted job {job.job_id}: run dir {run.run_dir}", flush=True)
    print(f"status: python -m launcher.launch.status {common}", flush=True)
    return wait_for(jobs, runs) if launcher["wait"] else 0


def wait_for(jobs: list[submitit.Job], runs: list[Submission]) -> int:
    failed = 0
    for job, run in zip(jobs, runs):
        try:
            job.results()
        except Exception:  # a raising task ends FAILED in Slurm, and fails the wait here
            failed += 1
            print(f"error: job {job.job_id} failed: run dir {run.run_dir}, log {job.paths.stdout}", file=sys.stderr)
    return 1 if failed else 0


def print_plan(runs: list[Submission], params: dict[str, Any], folder: Path) -> None:
    """launcher.dry_run=true: what would be submitted, and nothing submitted."""
    print(f"dry run: would submit {'a job array of ' + str(len(runs)) if len(runs) > 1 else 'one job'} "
          f"with submitit.SlurmExecutor(folder={folder})")
    print("executor parameters: " + json.dumps(params, sort_keys=True))
    for run in runs:
        cfg = OmegaConf.load(run.config_path)
        rendezvous = c10d_rendezvous("<first node address>:<port from the job id>", "<job id>-<requeue count>")
        args = torchrun_args(run.config_path, run.plan, cfg.launcher, rendezvous)
        print(f"run dir {run.run_dir}: {asdict(run.plan)}")
        print(f"  on each of {run.plan.nnodes} node(s): python -m torch.distributed.run {' '.join(args)}")
