"""`python -m launcher`: the only process that runs Hydra.

compose -> validate/derive (world size, accumulation) -> resolve once -> <run_dir>/config.yaml ->
start the workers here (launcher=local), or queue the run for Slurm (launcher=slurm). Exercised by: `python -m launcher +exp=toy` and `python -m launcher +exp=toy --cfg job`.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from itertools import islice
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from launcher.derived import ConfigError, compiles_each_block, unfused_step_note
from launcher.launch.checks import check_job_inputs
from launcher.launch.continue_run import continued_run_dir
from launcher.launch.cpu_precision import slow_precision_warning
from launcher.launch.environment import environment_record
from launcher.launch.errors import release_stderr
from launcher.launch.known_keys import check_known_keys
from launcher.launch.local import local_rendezvous, run_local, threads_per_worker, torchrun_args
from launcher.launch.optimizer_check import check_optimizer
from launcher.launch.plan import Plan, make_plan, resolve, write_config
from launcher.launch.resume import check_resume, finished
from launcher.launch.run_lock import LOCK_FILE, launch_lock
from launcher.launch.run_log import kept_in
from launcher.launch.shadowed_config import check_shadowed_configs, chosen_configs
from launcher.launch.slurm_jobs import active_job, job_goes_on
from launcher.launch.slurm_submit import dependency, queue
from launcher.launch.sweep_dir import MADE_FOR_RUN, absolute, remove_empty_above
from launcher.launch.sweep_points import check_every_point, goes_on_after, show_held
from launcher.launch.target_check import check_targets, job_files
from launcher.launch.tracker_start import hydra_point, mark_failed, start_trackers
from launcher.preempt import REQUEUE_EXIT_CODE, read_preempted, release_early_signals
from launcher.redact import redact_override
from launcher.rundir import LAUNCH_FILE, pinned_pretrained
from launcher.schema import register
from launcher.track.protocol import write_record
from launcher.train.phases import LAUNCH_TIME
from launcher.train.prefetch import usable_cores
from launcher.train.sharding import RULE as SHARDING_RULE

register()
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repo's conf/, as a file-system path
# What a run dir holds before our checks pass: Hydra's files, and the lock this launch holds
FRESH_RUN_DIR = {".hydra", "launcher.log", LOCK_FILE}


def write_launch_record(run_dir: Path, plan: Plan, cfg: DictConfig) -> None:
    record = {"command": [redact_override(arg) for arg in sys.argv], "host": platform.node(),
              "overrides": [redact_override(arg) for arg in HydraConfig.get().overrides.task],
              "plan": asdict(plan), **environment_record(run_dir, job_files(cfg))}
    (run_dir / LAUNCH_FILE).write_text(json.dumps(record, indent=2) + "\n")


def speed_line(config: dict, plan: Plan) -> str:
    """Precision and compile as the workers will run them, and which of them precision=auto / train.compile=auto
    chose: `precision bf16 (auto) | compiled (auto), one graph`."""
    auto = plan.auto or {}
    train = config["train"]
    name = config["precision"]["name"]  # still auto on Slurm: the workers choose it, on the nodes
    precision = f"precision {name}" + (" (auto)" if "precision" in auto else " (chosen on the nodes)" if name == "auto"
                                       else "")
    mode = "compiled" if train["compile"] is True else "eager"
    split = {True: ", cut at DDP's buckets", False: ", one graph"}.get(train["compile_ddp_split"], "") \
        if train["compile"] is True else ""
    if train["compile"] is True and compiles_each_block(config["strategy"]["name"], train["compile_scope"]):
        split = ", each block"
    shard_size = config["strategy"].get("shard_size")
    block = config["strategy"].get("block")
    sharded = (f" | strategy fsdp: {f'each {block}, then the root' if block else SHARDING_RULE}" +
               (f"; shard_size {shard_size}" if shard_size else "")
               if config["strategy"]["name"] == "fsdp" else "")
    return f"{precision} | {mode}{' (auto)' if 'compile' in auto else ''}{split}{sharded}"


def discard_if_fresh(run_dir: Path) -> None:
    """Leave no half-made run dir behind a config error; never touch one that holds a run."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= FRESH_RUN_DIR:
        shutil.rmtree(run_dir)
        made = MADE_FOR_RUN.get(absolute(run_dir))
        if made is not None:  # runs/<name>/ of a first launch of <name>: no empty dir either
            remove_empty_above(absolute(run_dir), made)


def shared_run_dir(nnodes: int) -> None:
    """Several nodes run the same command and must meet in one run dir: Hydra's default has each node's
    own launch time and pid in it."""
    given = {override.split("=", 1)[0].lstrip("+~") for override in HydraConfig.get().overrides.hydra}
    if not {"hydra.run.dir", "hydra.sweep.dir"} & given:
        raise ConfigError(f"launcher.nnodes={nnodes}: give every node the same hydra.run.dir=<a path on storage all "
                          f"nodes see> (the default run dir holds each node's own launch time and pid)")


# Hydra's options that take a value (--cfg job) and --info's optional one. argparse reads the overrides as one run of
# words after the options, so an option in their midst failed: `+exp=toy -m train.seed=1,2` was "unrecognized
# arguments: train.seed=1,2". (An override never starts with "-": key=value, +key, ~key.)
HYDRA_VALUE_OPTIONS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                       "--config-dir", "-cd", "--experimental-rerun"}
HYDRA_INFO_OPTIONS, HYDRA_INFO_CHOICES = {"--info", "-i"}, {"all", "config", "defaults", "defaults-tree", "plugins",
                                                             "searchpath"}


def flags_first(args: list[str]) -> list[str]:
    """The command's words with Hydra's options (each with its value) before the overrides: `+exp=toy -m
    train.seed=1,2` sweeps as `-m +exp=toy train.seed=1,2` does, `+exp=toy --cfg job x=1` prints that job."""
    options, overrides, words = [], [], iter(args)
    for word in words:
        if not word.startswith("-"):
            overrides.append(word)
            continue
        options.append(word)
        if word in HYDRA_VALUE_OPTIONS:
            options.extend(islice(words, 1))
        elif word in HYDRA_INFO_OPTIONS:  # its value is optional: a word that is none of its choices is an override
            following = list(islice(words, 1))
            (options if following and following[0] in HYDRA_INFO_CHOICES else overrides).extend(following)
    return options + overrides


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    release_stderr()  # Hydra composed the config: from here on our errors are one line already
    if HydraConfig.get().mode == RunMode.MULTIRUN and HydraConfig.get().job.num:  # a local sweep's next point
        os.environ[LAUNCH_TIME] = str(time.time())  # its start-up phases count from its own start, not the sweep's
    fresh = Path(HydraConfig.get().runtime.output_dir)
    try:
        launch_into(cfg, fresh)
    except KeyboardInterrupt:  # Ctrl-C before any worker (sacct, the lock, the checks): no half-made run dir either
        discard_if_fresh(fresh)
        raise


def launch_into(cfg: DictConfig, run_dir: Path) -> None:
    """The launch in Hydra's run dir, or in the unfinished run dir of the same command; one at a time in a run dir."""
    continued = continued_run_dir(cfg, run_dir)
    if continued:  # the same command again after a crash or Ctrl-C: its run goes on, not a new one from step 0
        discard_if_fresh(run_dir)
        run_dir = continued
    # The nodes of a multi-node local run each run this command in one run dir, by design
    nodes = cfg.launcher.name == "local" and str(cfg.launcher.get("nnodes", 1)) != "1"
    active = None if nodes else active_job(run_dir)  # before the lock: a queued job that starts meanwhile takes it
    if active:
        show_held()  # (Hydra's "#0 : ..." line of a sweep, which its checks would have shown)
        print(job_goes_on(run_dir, active), flush=True)
        return
    with nullcontext() if nodes else launch_lock(run_dir) as holder:
        if holder:  # its checkpoints change as we look: check nothing, write nothing
            if HydraConfig.get().mode == RunMode.MULTIRUN:  # two runs of one sweep's command share its points
                show_held()
                print(f"run dir {run_dir}: a launch ({holder}) runs this point; going on with the next", flush=True)
                return
            what = ("the last run of this same command: wait for it to end, or give hydra.run.dir=<a new dir> to train "
                    "a new run beside it" if continued else
                    "wait for it to end, or stop it first to start this command instead")
            print(f"error: run dir {run_dir}: a launch ({holder}) runs there; nothing started ({what})", file=sys.stderr,
                  flush=True)
            sys.exit(1)  # a script that launched it sees the refusal
        with kept_in(run_dir):  # launcher.log: what this launch prints, in the run dir
            if continued:
                print(f"continuing run dir {run_dir}: the last run of this same command is unfinished (resume=never "
                      f"or hydra.run.dir=<a new dir> starts a new run)", flush=True)
            launch(cfg, run_dir)


def checked_config(cfg: DictConfig, run_dir: Path,
                   overrides: list[str] | None = None) -> tuple[Plan, dict, int | None]:
    """The parent's checks of the config itself, in order (ConfigError names the key): the plan, the resolved
    config the workers read, and the step a resume starts from. `overrides`: a sweep point's (else this launch's)."""
    configs = chosen_configs(overrides)
    check_shadowed_configs(configs)  # ~/myjobs/conf/model/mlp.yaml lost to conf/model/mlp.yaml in silence
    check_targets(cfg)  # a job of one's own without PYTHONPATH failed each worker after the rendezvous
    check_known_keys(cfg, configs)  # +train.max_step=20 would train 200 steps with a key nothing reads
    plan = make_plan(cfg)
    check_optimizer(cfg.optimizer)  # optimizer.weight_decay=abc failed every rank, naming no key
    if plan.nnodes > 1 and cfg.launcher.name == "local":
        shared_run_dir(plan.nnodes)
    config = resolve(cfg, plan)
    return plan, config, check_resume(run_dir, config)


def check_inputs(config: dict, run_dir: Path) -> None:
    """The parent's checks of what the run reads (ConfigError): the job's data and models, and with launcher=slurm
    the jobs that launcher.dependency / launcher.after name."""
    check_job_inputs(config, pinned_pretrained(run_dir))
    if config["launcher"]["name"] == "slurm":
        dependency(config["launcher"])


def notes_before_the_start(plan: Plan, config: dict) -> list[str]:
    """What a local launch says before its workers start: a precision this CPU emulates, an optimizer step that waits
    for the GPU, more CPU workers than cores (a step waits for the slowest), a warmup as long as the run, and a command
    that names no experiment."""
    notes = [slow_precision_warning(config["precision"]["name"])
             if plan.device_type == "cpu" and config["precision"]["name"] in ("bf16", "fp16") else None]
    warmup, steps = config["scheduler"]["warmup_steps"], config["train"]["max_steps"]
    if 0 < steps < warmup:  # (scheduler.lr_factor: step s of the warmup is (s + 1) / warmup_steps of the lr)
        notes.append(f"warning: scheduler.warmup_steps={warmup} > train.max_steps={steps}: the learning rate warms up "
                     f"for the whole run and reaches {steps / warmup:.2g} of optimizer.lr at its end")
    if plan.device_type == "cuda":
        notes.append(unfused_step_note(config["optimizer"], config["strategy"]["name"]))
    cores = usable_cores()
    if plan.device_type == "cpu" and plan.nproc_per_node > cores:
        notes.append(f"warning: {plan.nproc_per_node} CPU workers on {cores} cores take turns on them; "
                     f"launcher.nproc_per_node={cores} or fewer trains the same steps faster")
    hydra = HydraConfig.get()
    chosen, given = hydra.runtime.choices, {o.split("=")[0].lstrip("+~") for o in hydra.overrides.task}
    if "exp" not in chosen and not {"model", "data"} & given:
        exps = ", ".join(sorted(path.stem for path in (CONF_DIR / "exp").glob("*.yaml")))
        notes.append(f"note: no +exp=<name>: training the defaults (model={chosen.get('model')}, "
                     f"data={chosen.get('data')}); the experiments are {exps}")
    return [note for note in notes if note]


def check_point(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """A sweep point's checks, as its own launch makes them: a point that finished is skipped before its inputs."""
    _, config, resume_step = checked_config(cfg, run_dir, overrides)
    if not finished(run_dir, config, resume_step):
        check_inputs(config, run_dir)


def launch(cfg: DictConfig, run_dir: Path) -> None:
    """Check, resolve and write the run's config, then run its workers here or queue its Slurm job."""
    if cfg.launcher.name == "slurm":  # no agent will start here to end as preempted
        release_early_signals()
    try:
        check_every_point(check_point)
        plan, config, resume_step = checked_config(cfg, run_dir)
        # A finished run starts nothing (nor one whose Slurm job goes on: main): the command of a sweep whose points
        # ended apart (some failed, some were cancelled) runs again as a whole and queues only what is left
        done = finished(run_dir, config, resume_step)
        if done:
            print(done, flush=True)
            return
        check_inputs(config, run_dir)  # (inputs of a finished run may be gone meanwhile)
        point = hydra_point(run_dir)
        trackers = start_trackers(run_dir, config, point, cfg.launcher.dry_run)  # the last check
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        discard_if_fresh(run_dir)
        sys.exit(2)
    new = not (run_dir / "config.yaml").exists()  # no run in it before: a Slurm submission that fails removes it
    config_path = write_config(run_dir, config)
    write_launch_record(run_dir, plan, cfg)
    if trackers:  # every start of the workers (relaunch, restart, requeue) reopens these tracker runs
        write_record(run_dir, trackers)
    if cfg.launcher.name == "slurm":  # submitted by __main__ once Hydra has run every sweep point
        queue(run_dir, config_path, plan, cfg.launcher, point.sweep_dir, new)
        return
    resuming = "" if resume_step is None else f" | resuming (latest checkpoint: step {resume_step})"
    for note in notes_before_the_start(plan, config):
        print(note, file=sys.stderr, flush=True)
    threads = threads_per_worker(plan)
    each = f", {threads} thread(s) each" if threads else ""  # (OMP_NUM_THREADS, unless the user set it)
    print(f"run dir {run_dir} | {plan.world_size} worker(s) on {plan.device_type}{each} | "
          f"grad accum {plan.grad_accum_steps or 'auto (the workers find the micro-batch)'} | "
          f"{speed_line(config, plan)}{resuming}", flush=True)
    if cfg.launcher.dry_run:  # the config is written and checked; show what would run, start nothing
        args = torchrun_args(config_path, plan, cfg.launcher, local_rendezvous(plan, cfg.launcher, run_dir))
        print(f"dry run: would run python -m torch.distributed.run {' '.join(args)}", flush=True)
        return
    code = run_local(config_path, plan, cfg.launcher, config, point.sweep_dir)
    stop = read_preempted(run_dir) if code == REQUEUE_EXIT_CODE else None
    if stop and not stop.get("saved", True):  # no rank 0 told the trackers of this stop (a save does)
        mark_failed(run_dir, config, 128 + stop["signal"])
    elif code and code != REQUEUE_EXIT_CODE:
        mark_failed(run_dir, config, code)
    if code and not goes_on_after(run_dir, code, plan.nnodes):  # a failed point of a local sweep: the next one
        sys.exit(code)
