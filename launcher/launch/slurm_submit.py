"""Submitting runs to Slurm through submitit: one job, or one job array for a Hydra `-m` sweep, whose tasks run
launcher/launch/slurm.py's NodeTask. Nothing is left half-made when the submission fails.

Exercised by: `python -m launcher +exp=toy launcher=slurm` and tests/test_slurm.py (a real cluster).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import submitit
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from submitit.core.utils import FailedJobError

from launcher.derived import ConfigError
from launcher.launch.local import c10d_rendezvous, torchrun_args
from launcher.launch.plan import Plan
from launcher.launch.run_log import failure_line
from launcher.launch.slurm import NodeTask
from launcher.launch.slurm_jobs import (ACTIVE, JOB_FILE, dependency_problem, ended_states, recorded_job,
                                        slurm_state)
from launcher.launch.sweep_dir import NOT_RUNS
from launcher.launch.tracker_start import mark_failed
from launcher.preempt import signal_named
from launcher.rundir import ERROR_FILE, SUMMARY_FILE


@dataclass
class Submission:
    run_dir: Path
    config_path: Path
    plan: Plan
    launcher: dict[str, Any]
    sweep_dir: Path | None  # -m: the sweep's dir (its points may be fewer than the sweep's: the finished are not)
    new: bool  # the run dir held no run before this launch: a failed submission removes it


QUEUE: list[Submission] = []  # filled by the Hydra task for each run; submitted once Hydra is done
UNREACHABLE = "Unable to contact slurm controller"  # sbatch's words when no controller answers (it is down)
# What sbatch may refuse: named in the error line, as the keys to check against the cluster (sinfo, sacctmgr)
REQUESTED = ("partition", "account", "qos", "constraint", "nodes", "gpus_per_node", "cpus_per_task", "mem_gb",
             "timeout_min")


def queue(run_dir: Path, config_path: Path, plan: Plan, launcher: DictConfig, sweep_dir: Path | None,
          new: bool) -> None:
    QUEUE.append(Submission(run_dir, config_path, plan, OmegaConf.to_container(launcher, enum_to_str=True), sweep_dir,
                            new))


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
        problem = dependency_refusal(launcher["dependency"])
        if problem:
            raise ConfigError(f"launcher.dependency={launcher['dependency']}: {problem}; name a job that squeue or "
                              f"sacct lists (or drop launcher.dependency)")
        parts.append(launcher["dependency"])
    if launcher["after"]:
        after = Path(launcher["after"])
        job_id = recorded_job(after)
        if job_id is None:
            raise ConfigError(f"launcher.after={after} holds no {JOB_FILE}: name the run dir of a run submitted with "
                              f"launcher=slurm")
        state = after_state(job_id)
        # Ended without completing: Slurm's afterok would hold only while Slurm remembers the job (MinJobAge), and
        # then let this run start from one that never finished
        if state not in ACTIVE | {"COMPLETED", "UNKNOWN"} and not (after / SUMMARY_FILE).is_file():  # (it ended)
            raise ConfigError(f"launcher.after={after}: its job {job_id} ended {state} before the run finished; "
                              f"resubmit it (hydra.run.dir={after}), then this run with launcher.after again")
        if state in ACTIVE or state == "UNKNOWN":  # UNKNOWN: neither sacct nor squeue answered; Slurm judges the id
            parts.append(f"afterok:{job_id}")
    return ",".join(parts) or None


@functools.lru_cache
def dependency_refusal(dependency: str) -> str | None:
    """Why Slurm would not wait as launcher.dependency asks, or None; asked once per launch, as after_state. Clauses
    joined by ',' must all be met, by '?' one of them (Slurm takes one kind of joint in a dependency)."""
    problems = [dependency_problem([job.split("+")[0] for job in ids], kind) if ids else None  # (after:<id>+<min>)
                for kind, *ids in (clause.split(":") for clause in re.split(r"[,?]", dependency))]
    if "?" in dependency:
        return problems[0] if all(problems) else None
    return next((problem for problem in problems if problem), None)


@functools.lru_cache
def after_state(job_id: str) -> str:
    """launcher.after's job's state, asked of Slurm once per launch: every sweep point checks it, and the submission
    again (Slurm asks programs not to call sacct in a loop)."""
    return slurm_state(job_id)


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
    cpus = launcher["cpus_per_task"] or plan.nproc_per_node
    # srun is told the CPUs again: from Slurm 22.05 to 23.02 a step does not inherit sbatch's --cpus-per-task, and
    # where tasks are bound to cores (task/affinity, task/cgroup) the agent and all of a node's workers shared one
    params = {"job_name": job_name, "nodes": plan.nnodes, "ntasks_per_node": 1, "cpus_per_task": cpus,
              "srun_args": [f"--cpus-per-task={cpus}"], "time": launcher["timeout_min"],
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


class ArrayWords(Callback, logging.Filter):
    """A launcher=slurm sweep's first line says what happens: Hydra's basic launcher, which runs the points one by one
    here (each queues its run), would say "Launching N jobs locally" of what becomes one Slurm job array."""

    LOGGER = "hydra._internal.core_plugins.basic_launcher"

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.launcher.name == "slurm":
            self.then = "showing what would be submitted (dry run)" if config.launcher.dry_run else "submitting them"
            logging.getLogger(self.LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        if said.startswith("Launching ") and said.endswith(" jobs locally"):
            points = said.removeprefix("Launching ").removesuffix(" jobs locally")
            record.msg, record.args = f"Checking {points} sweep points, then {self.then} as one Slurm job array", ()
        return True


def submit_queued() -> int:
    """Submit what the Hydra task queued: one job, or one array for a sweep. Returns the exit code; on an error
    the runs stay queued, for discard_queued."""
    if not QUEUE:
        return 0
    runs = list(QUEUE)
    launcher, plan = runs[0].launcher, runs[0].plan
    common = runs[0].sweep_dir or runs[0].run_dir
    folder = Path(launcher["log_dir"] or common / "slurm")
    try:
        _same_submission(runs)
        params = executor_parameters(launcher, plan, job_name=OmegaConf.load(runs[0].config_path).name)
        if launcher["dry_run"]:
            QUEUE.clear()  # checked, resolved and written, as a local dry run leaves it
            print_plan(runs, params, folder)
            return 0
        submitted_at = time.time()  # (an error.txt older than this is an earlier start's)
        executor = submitit.SlurmExecutor(folder=folder)
        executor.update_parameters(**params)
        with sbatch_stderr() as said, executor.batch():  # several submissions in a batch become one job array
            jobs = [executor.submit(NodeTask(str(run.config_path))) for run in runs]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FailedJobError as err:  # sbatch refused the job: what the cluster has not (a partition, the nodes)
        why = [line.removeprefix("sbatch: error: ").strip() for line in said if line.startswith("sbatch: error:")]
        if any(UNREACHABLE in line for line in why):  # no keys to blame: nobody answered
            print(f"error: sbatch could not reach the Slurm controller ({'; '.join(why)}); nothing was submitted: check "
                  f"that slurmctld runs and answers (scontrol ping), then launch again", file=sys.stderr)
            return 1
        asked = [f"launcher.{key}={launcher[key]}" for key in REQUESTED if launcher[key]]
        if not launcher["cpus_per_task"]:  # unset: a CPU per worker, so a refused CPU count is this key's
            asked.append(f"launcher.nproc_per_node={plan.nproc_per_node} (a CPU each)")
        print(f"error: sbatch refused the job: {'; '.join(why) or str(err).strip()} ({', '.join(asked)}); check them "
              f"against the cluster (sinfo, sacctmgr show assoc)", file=sys.stderr)
        return 2
    for line in said:  # sbatch's warnings, if any
        print(line, file=sys.stderr)
    QUEUE.clear()
    for job, run in zip(jobs, runs):
        (run.run_dir / JOB_FILE).write_text(json.dumps({"job_id": job.job_id, "log_dir": str(folder)}) + "\n")
        print(f"submitted job {job.job_id}: run dir {run.run_dir}", flush=True)
    print(f"status: python -m launcher.launch.status {common}", flush=True)
    return wait_for(jobs, runs, submitted_at) if launcher["wait"] else 0


@contextmanager
def sbatch_stderr() -> Iterator[list[str]]:
    """The lines sbatch (submitit's child process) writes to stderr meanwhile: said in the one line of a refusal."""
    said: list[str] = []
    sys.stderr.flush()
    kept = os.dup(2)
    with tempfile.TemporaryFile("w+") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield said
        finally:
            sys.stderr.flush()
            os.dup2(kept, 2)
            os.close(kept)
            caught.seek(0)
            said.extend(line for line in caught.read().splitlines() if line.strip())


def discard_queued() -> None:
    """Runs queued but never submitted (an error in a later sweep point, or the submission failed): their tracker
    runs end FAILED, and the run dirs this launch made are removed, with the sweep dir when nothing else is in it."""
    for run in QUEUE:
        mark_failed(run.run_dir, OmegaConf.to_container(OmegaConf.load(run.config_path)), 2)
        if run.new:
            shutil.rmtree(run.run_dir, ignore_errors=True)
    sweeps = {run.sweep_dir for run in QUEUE if run.sweep_dir and run.sweep_dir.is_dir()}
    QUEUE.clear()
    for sweep_dir in sweeps:  # Hydra's multirun.yaml, and what submitit wrote of the refused array
        if {p.name for p in sweep_dir.iterdir()} <= NOT_RUNS:
            shutil.rmtree(sweep_dir, ignore_errors=True)


def wait_for(jobs: list[submitit.Job], runs: list[Submission], submitted_at: float) -> int:
    """launcher.wait=true: until every job has ended; 1 when one did not complete, said with the error line its start
    recorded (error.txt, where one of its nodes wrote one). Ctrl-C stops the wait only."""
    failed = 0
    try:
        for job, run in zip(jobs, runs):
            try:
                job.results()
            except Exception:  # a raising task ends FAILED in Slurm (CANCELLED: a scancel), and fails the wait here
                failed += 1
                error = run.run_dir / ERROR_FILE  # (a job cancelled while pending wrote none: not an earlier start's)
                why = failure_line(run.run_dir) if error.is_file() and error.stat().st_mtime >= submitted_at else None
                why = why.removeprefix("error: ").replace(f" (run dir {run.run_dir})", "") if why else "see its log"
                print(f"error: job {job.job_id} ended {ended_states([job.job_id])[job.job_id]}: {why}; run dir "
                      f"{run.run_dir}, log {job.paths.stdout}; relaunch with hydra.run.dir={run.run_dir} to resume",
                      file=sys.stderr)
        ended_states([job.job_id for job in jobs])  # the wait ends once Slurm says so: a status then agrees
    except KeyboardInterrupt:
        ids = " ".join(job.job_id for job in jobs)
        print(f"stopped waiting; the job(s) go on: python -m launcher.launch.status {runs[0].sweep_dir or runs[0].run_dir}"
              f" (scancel {ids} to stop them)", file=sys.stderr)
        return 130
    return 1 if failed else 0


def print_plan(runs: list[Submission], params: dict[str, Any], folder: Path) -> None:
    """launcher.dry_run=true: what would be submitted, and nothing submitted."""
    print(f"dry run: would submit {'a job array of ' + str(len(runs)) if len(runs) > 1 else 'one job'} "
          f"with submitit.SlurmExecutor(folder={folder})")
    print("executor parameters: " + json.dumps(params, sort_keys=True))
    for run in runs:
        cfg = OmegaConf.load(run.config_path)
        rendezvous = [arg.replace("is_host=1", "is_host=<1 on the first node, else 0>") for arg in c10d_rendezvous(
            "<first node address>:<port from the job id>", "<job id>-<requeue count>", cfg.launcher.rdzv_timeout_s,
            hosts=True, workers_at="<the node's address toward the first node>")]
        args = torchrun_args(run.config_path, run.plan, cfg.launcher, rendezvous)
        print(f"run dir {run.run_dir}: {asdict(run.plan)}")
        print(f"  on each of {run.plan.nnodes} node(s): python -m torch.distributed.run {' '.join(args)}")
