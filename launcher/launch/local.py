"""Run the workers on this machine through torchrun's elastic agent, inside the parent process.

`--standalone` gives a c10d rendezvous on a free localhost port, so two jobs on one host never clash
on 29500; with launcher.nnodes > 1 every node runs the same command and the agents meet at
launcher.rdzv_endpoint. The agent relays SIGTERM and the preemption signal to every worker and gives them
`launcher.shutdown_timeout_s` to checkpoint. Exercised by: `python -m launcher +exp=toy`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError

from launcher.compat import (FLIGHT_RECORDER_BUFFER_SIZE, FLIGHT_RECORDER_DUMP_FILE, fallback_notes, relay_signals,
                             torchrun_shutdown_args, torchrun_signal_args)
from launcher.derived import NODE_CONFIG, node_view
from launcher.interrupted import say_on_ctrl_c
from launcher.launch.agent_log import left_out_when_said
from launcher.launch.plan import Plan
from launcher.launch.run_log import forget_failure, record_failure
from launcher.launch.workers_address import gloo_interface, serves_rendezvous, workers_address
from launcher.preempt import (PREEMPTED_FILE, REQUEUE_EXIT_CODE, early_signal, preemption_signals, read_preempted,
                              stop_line, write_preempted)
from launcher.rundir import HANG_DIR, SUMMARY_FILE, complete_steps, hang_summary
from launcher.train.orphan import AGENT_PID
from launcher.train.phases import LAUNCH_TIME
from launcher.train.prefetch import usable_cores

COMM_TRACES_DIR = "comm_traces"  # NCCL flight recorder dumps, one file per rank, when a collective times out


def torchrun_args(config_path: Path, plan: Plan, launcher: DictConfig, rendezvous: list[str]) -> list[str]:
    """torchrun's arguments for one node: `rendezvous` is --standalone here, c10d at the first node on Slurm."""
    nnodes = f"{plan.min_nnodes}:{plan.nnodes}" if plan.min_nnodes else plan.nnodes
    return [*rendezvous, f"--nnodes={nnodes}", f"--nproc-per-node={plan.nproc_per_node}",
            f"--max-restarts={launcher.max_restarts}", *torchrun_signal_args(preemption_signals(launcher.signal)),
            *torchrun_shutdown_args(launcher.shutdown_timeout_s), "--module", "launcher.train.worker", str(config_path)]


def c10d_rendezvous(endpoint: str, rdzv_id: str, timeout_s: int, hosts: bool | None,
                    workers_at: str | None) -> list[str]:
    """torchrun's rendezvous arguments for a multi-node job: every node's agent meets at `endpoint`; its connection
    and its wait for the other nodes (one that failed before its agent started) both end after `timeout_s`.
    `hosts`: whether this node's agent serves the endpoint's store. None leaves it to torch, which compares the
    endpoint with what this machine's hostname resolves to: where that is 127.0.1.1 (Debian's and Ubuntu's
    /etc/hosts) or another network card's address, no node serves it and every agent waits for the timeout.
    `workers_at`: where the workers find rank 0's store should this node's agent be rank 0 (torchrun's
    --local-addr; None: torch's getfqdn() of this machine), an address rather than a name that may resolve nowhere
    else (launcher/launch/workers_address.py)."""
    is_host = "" if hosts is None else f",is_host={int(hosts)}"
    local_addr = [f"--local-addr={workers_at}"] if workers_at else []
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=join_timeout={timeout_s},read_timeout={timeout_s}{is_host}", *local_addr]


def local_rendezvous(plan: Plan, launcher: DictConfig, run_dir: Path) -> list[str]:
    """--standalone on one node (a free localhost port); on several, c10d at launcher.rdzv_endpoint (waits of
    launcher.rdzv_timeout_s). Alone, the workers find the agent's store at localhost: where this machine's name
    resolves nowhere (torch's address for it), a run of one node would wait 300 s and fail."""
    if plan.nnodes == 1:
        return ["--standalone", "--local-addr=localhost"]
    if launcher.node_rank is not None:  # static: node 0 serves the endpoint, every node names its own rank
        return ["--rdzv-backend=static", f"--rdzv-endpoint={launcher.rdzv_endpoint}",
                f"--node-rank={launcher.node_rank}", f"--rdzv-conf=timeout={launcher.rdzv_timeout_s}"]
    rdzv_id = launcher.rdzv_id or "launcher-" + hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return c10d_rendezvous(launcher.rdzv_endpoint, rdzv_id, launcher.rdzv_timeout_s,
                           hosts=serves_rendezvous(launcher.rdzv_endpoint),
                           workers_at=workers_address(launcher.rdzv_endpoint))


def run_local(config_path: Path, plan: Plan, launcher: DictConfig, config: dict[str, Any],
              sweep_dir: Path | None = None) -> int:
    """This node's workers; returns the exit code: 0, REQUEUE_EXIT_CODE, or the failed rank's. With several
    nodes, each node's workers also get the config its own launcher resolved, to compare across nodes."""
    (config_path.parent / PREEMPTED_FILE).unlink(missing_ok=True)  # an earlier launch's marker means nothing
    node = {NODE_CONFIG: json.dumps(node_view(config, config_path.parent))} if plan.nnodes > 1 else {}
    return run_agent(config_path, plan, launcher, local_rendezvous(plan, launcher, config_path.parent), node,
                     sweep_dir)


def summary_stamp(run_dir: Path) -> int | None:
    """When summary.json was last written (None: there is none): rank 0's last write, at the run's end."""
    try:
        return (run_dir / SUMMARY_FILE).stat().st_mtime_ns
    except OSError:
        return None


def last_line(message: str) -> str:
    """The line of a rank's error that says what failed: the last one not indented (OmegaConf's errors end in
    indented `full_key: ...` and `object_type=dict` lines, which alone say nothing)."""
    lines = [line for line in message.strip().splitlines() if line.strip()] or [message]
    return next((line for line in reversed(lines) if not line[:1].isspace()), lines[-1]).strip()


def failure_reason(message: str) -> str:
    """The line a rank's error is told by, with the launcher's key where torch names only its own argument."""
    if "You can enable unused parameter detection" in message:  # DDP's, at the next step's forward (not when it is on)
        unused = re.search(r"Parameter indices which did not receive grad for rank \d+: [\d ]+", message)
        return (f"the model has parameters that no loss used in the last step (DDP: "
                f"{unused.group(0).strip() if unused else 'reduction not finished'}); set "
                f"dist.find_unused_parameters=true (slower: DDP searches the graph every step), or leave them out")
    return last_line(message)


def rendezvous_endpoint(rendezvous: list[str]) -> str:
    return next((arg.split("=", 1)[1] for arg in rendezvous if arg.startswith("--rdzv-endpoint=")), "localhost")


def threads_per_worker(plan: Plan) -> int | None:
    """The intra-op threads of each worker: this node's cores shared out among its workers (None: the user's own
    OMP_NUM_THREADS stands)."""
    return None if "OMP_NUM_THREADS" in os.environ else cores_each(plan)


def cores_each(plan: Plan) -> int:
    """This node's cores shared out among its workers (at least one each)."""
    return max(1, usable_cores() // plan.nproc_per_node)


def worker_env(plan: Plan, run_dir: Path) -> dict[str, str]:
    """What the agent's workers get on top of this process's environment (a user's own setting wins).

    Every worker learns the agent's pid, so that it ends with this process (launcher/train/orphan.py), and its
    share of the node's cores as OMP_NUM_THREADS (the launcher's first line says how many) and as inductor's compile
    workers. A CPU plan's workers get CUDA_VISIBLE_DEVICES="": they never see, or initialise, a GPU. A CUDA plan's
    workers get the CUDA allocator's expandable segments, and NCCL's flight recorder (each rank's last 2000
    collectives; torch records none before 2.11 unless told) dumps into <run_dir>/comm_traces/ when a collective
    times out, under the variables' names that this torch reads (launcher/compat.py).
    """
    env = {AGENT_PID: str(os.getpid())}  # the agent runs in this process: the workers end with it
    env[LAUNCH_TIME] = os.environ.get(LAUNCH_TIME) or str(time.time())  # their start-up phases count from it
    threads = threads_per_worker(plan)
    if threads:  # else torchrun sets 1 for several workers, with a banner that says to tune it
        env["OMP_NUM_THREADS"] = str(threads)
    # Inductor's compile workers: each rank starts min(32, the node's cores) of its own (pytorch#190941), at every
    # start of a compiled run, a warm cache's too: 8 ranks, 256 processes importing torch beside their trace. Each
    # rank gets its share of the cores instead (1: it compiles in its own process)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(cores_each(plan))
    if plan.device_type == "cpu":
        return {**env, "CUDA_VISIBLE_DEVICES": ""}
    # Expandable segments: less fragmentation, so fewer out-of-memory errors at a size that fits. The old
    # name: every torch from 2.6 reads it (2.8-2.11 warn that it is deprecated), while 2.9 ignored
    # expandable_segments under the new PYTORCH_ALLOC_CONF (pytorch#183387).
    if not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ:
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    # the user's own setting, under a name this torch reads (every torch reads the TORCH_NCCL_ ones)
    if not {FLIGHT_RECORDER_BUFFER_SIZE, "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        env[FLIGHT_RECORDER_BUFFER_SIZE] = "2000"  # torch's own default from 2.11
    if not {FLIGHT_RECORDER_DUMP_FILE, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(os.environ):
        env[FLIGHT_RECORDER_DUMP_FILE] = str(run_dir / COMM_TRACES_DIR / "rank_")
    return env


@contextmanager
def environment(updates: dict[str, str]) -> Iterator[None]:
    """`updates` in os.environ while the agent starts its workers (they copy it); afterwards the whole
    environment as it was (torchrun also sets OMP_NUM_THREADS), so the next point of a local -m sweep (the
    same process) plans with the user's environment again."""
    before = dict(os.environ)
    os.environ.update(updates)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def run_agent(config_path: Path, plan: Plan, launcher: DictConfig, rendezvous: list[str],
              extra_env: dict[str, str] | None = None, sweep_dir: Path | None = None) -> int:
    """Run torchrun's agent for this node's workers in this process and wait; returns the node's exit code.
    `sweep_dir`: the run is a point of that local -m sweep, whose command resumes it after a stop."""
    run_dir, signals = config_path.parent, preemption_signals(launcher.signal)
    shutil.rmtree(run_dir / HANG_DIR, ignore_errors=True)  # reports of an earlier launch say nothing now
    forget_failure(run_dir)  # (its error.txt neither)
    env = {**worker_env(plan, run_dir), **(extra_env or {})}
    if plan.nnodes > 1:  # gloo's ranks of the other machines reach this one (launcher/launch/workers_address.py)
        env.update(gloo_interface(rendezvous_endpoint(rendezvous)))
    if plan.device_type == "cuda":  # where the flight recorder dumps (torch does not make the folder)
        (run_dir / COMM_TRACES_DIR).mkdir(exist_ok=True)
    for note in fallback_notes(signals, launcher.shutdown_timeout_s):
        print(note, file=sys.stderr, flush=True)
    summary_before, got = summary_stamp(run_dir), 0  # `got`: a signal this node's agent relayed to its workers
    say_on_ctrl_c("stopped by SIGINT")  # (past this, one that no agent relays comes between runs of a local sweep)
    try:
        started = early_signal() not in signals  # one kept since the launcher started: no worker starts
        if not started:
            raise SignalException(f"got signal {early_signal()} before the workers started", sigval=early_signal())
        # (torchrun's W/E lines on the failure or stop that our line names, without restarts)
        with relay_signals(signals), environment(env), left_out_when_said(launcher.max_restarts == 0):
            torchrun.run(torchrun.parse_args(torchrun_args(config_path, plan, launcher, rendezvous)))
    except SignalException as err:  # the agent relayed it and waited for the workers' checkpoint
        code, got = 128 + int(err.sigval), int(err.sigval)
        ended, stop = summary_stamp(run_dir), read_preempted(run_dir)  # summary.json: rank 0's last write, at the end
        if ended is not None and ended != summary_before and not (stop and stop.get("saved", True)):
            print(f"the run ended before {signal.Signals(err.sigval).name} could stop it: nothing to resume", file=sys.stderr)
            return 0  # (a fresh start deletes an earlier summary.json: only one written now counts)
        if err.sigval in signals and stop is None:  # they saved none: a requeue goes on all the same
            write_preempted(run_dir, (complete_steps(run_dir) or [0])[-1], err.sigval, saved=False, started=started)
        elif err.sigval not in signals:  # SIGHUP (a closed terminal), SIGQUIT: the agent ended the workers, unsaved
            print(f"stopped by {signal.Signals(err.sigval).name}, which saves no checkpoint (launcher.signal and "
                  f"SIGTERM/SIGINT do); a relaunch resumes from the latest one (exit code {code})", file=sys.stderr)
            return code
    except (RendezvousError, DistStoreError, DistNetworkError) as err:  # nobody serves the endpoint, nodes missing
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        fix = ("another node of the job failed before its agent started: see the job's other logs" if
               launcher.name == "slurm" else "start the same command on every node, with an endpoint they all reach")
        line = (f"error: the rendezvous of {plan.nnodes} nodes at {rendezvous_endpoint(rendezvous)} failed: {why} "
                f"(launcher.rdzv_timeout_s={launcher.rdzv_timeout_s}); {fix}")
        print(line, file=sys.stderr)
        record_failure(run_dir, line)
        return 1
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        if code != REQUEUE_EXIT_CODE:
            message = failure.message  # from the worker's error file: a dict, or a plain string
            stack = ""
            if isinstance(message, dict):
                stack = (message.get("extraInfo") or {}).get("py_callstack", "")
                message = message.get("message", "")
            reason = failure_reason(str(message)) if message else f"exit code {failure.exitcode}"
            hung = hang_summary(run_dir)
            line = f"error: rank {rank} failed: {reason} (run dir {run_dir}){'; ' + hung if hung else ''}"
            print(line, file=sys.stderr)
            record_failure(run_dir, line, f"rank {rank}'s traceback:\n{stack or message}")
            return code
    else:
        code = 0
    preempted = read_preempted(run_dir)
    if preempted is not None:  # rank 0's record: another node's rank 0, where this node's Ctrl-C stopped the run
        said = {**preempted, "signal": preempted["signal"] or got}
        print(stop_line(said, run_dir, sweep_dir, launcher.name != "slurm"), file=sys.stderr)
        return REQUEUE_EXIT_CODE
    return code
