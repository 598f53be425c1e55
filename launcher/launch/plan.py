"""Validate a composed config and derive what is not configured: world size and accumulation.

Runs in the parent before any process starts; every error names the key and the fix in one line.
Exercised by: `python -m launcher +exp=toy train.global_batch_size=30` (fails: not divisible).
"""
from __future__ import annotations

import dataclasses
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.derived import (COMPILE_MODES, CUDA_GRAPH_MODES, ConfigError, auto_ddp_split, auto_precision,
                              compiles_each_block, grad_accum_steps)
from launcher.launch.gpus import visible_gpus
from launcher.launch.strategy_check import check_strategy
from launcher.preempt import signal_named
from launcher.rundir import write_atomically
from launcher.schema import SLURM_RESOURCE_KEYS, LauncherConfig


@dataclass(frozen=True)
class Plan:
    nnodes: int
    nproc_per_node: int
    world_size: int
    grad_accum_steps: int | None  # None: train.micro_batch_size=auto, decided by the workers
    device_type: str  # "cuda" or "cpu"
    min_nnodes: int | None = None  # elastic (launcher.nnodes=MIN:MAX): the run may go on with this many nodes
    # what precision=auto and train.compile=auto chose ({"precision": "bf16", "compile": true}); a Slurm job's
    # precision is chosen on its nodes, by the workers (the submit host cannot see the cluster's GPUs)
    auto: dict[str, Any] | None = None


def _require_positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):  # (untyped groups)
            raise ConfigError(f"{key}={value} is not a number")
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value} must be > 0")


def _require_one_of(cfg: DictConfig, key: str, *options: str | None) -> None:
    if OmegaConf.select(cfg, key) not in options:
        names = ", ".join("null" if option is None else option for option in options)
        raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} is not one of {names}")


def _shape(cfg: DictConfig) -> tuple[int, int, int, str, list[tuple[int, int]] | None]:
    """(fewest nodes, nodes, workers per node, device type, the GPUs' compute capabilities or None where unknown
    here) for this launcher: fewer nodes only with an elastic launcher.nnodes=MIN:MAX; the device is decided
    here, once."""
    launcher = cfg.launcher
    device = getattr(launcher.device, "value", launcher.device)  # an Enum when typed
    if launcher.name == "slurm":  # the submit host's GPUs say nothing about the cluster's
        _require_positive(cfg, "launcher.nodes", "launcher.timeout_min", "launcher.array_parallelism",
                          "launcher.cpus_per_task", "launcher.mem_gb")
        for key in ("launcher.gpus_per_node", "launcher.max_requeues", "launcher.signal_delay_s"):
            if OmegaConf.select(cfg, key) < 0:
                raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 0")
        if launcher.signal_delay_s >= launcher.timeout_min * 60:  # the warning would come before the job started
            raise ConfigError(f"launcher.signal_delay_s={launcher.signal_delay_s} is not below launcher.timeout_min="
                              f"{launcher.timeout_min} minutes: Slurm would send launcher.signal as the job starts, "
                              f"which ends it before the workers run; lower launcher.signal_delay_s or raise "
                              f"launcher.timeout_min")
        # scancel and Slurm's own requeue send SIGTERM (and srun's Ctrl-C SIGINT): a job that requeued itself on it
        # could not be cancelled, so only launcher.signal, Slurm's warning before the time limit, requeues
        if signal_named(launcher.signal) in (signal.SIGTERM, signal.SIGINT):
            raise ConfigError(f"launcher.signal={launcher.signal} on Slurm cannot tell the time limit's warning "
                              f"from a scancel, so the job would not requeue itself; use USR2 (the default) or USR1")
        gpus = launcher.gpus_per_node
        if device == "cuda" and not gpus:
            raise ConfigError("launcher.device=cuda but launcher.gpus_per_node=0 asks Slurm for no GPU; "
                              "set launcher.gpus_per_node to the GPUs per node")
        if device == "cpu" and gpus:
            raise ConfigError(f"launcher.device=cpu but launcher.gpus_per_node={gpus} asks Slurm for GPUs; "
                              f"set launcher.gpus_per_node=0 for CPU workers")
        if str(launcher.nnodes) != "1" or launcher.rdzv_endpoint:
            raise ConfigError("launcher.nnodes and launcher.rdzv_endpoint are for launcher=local on several machines; "
                              "on Slurm set launcher.nodes (the rendezvous is the job's first node)")
        nproc = launcher.nproc_per_node or gpus or 2
        if gpus and nproc > gpus:
            raise ConfigError(f"launcher.nproc_per_node={nproc} but launcher.gpus_per_node={gpus}: a worker per GPU at "
                              f"most; set launcher.nproc_per_node<={gpus} (null: one per GPU)")
        return launcher.nodes, launcher.nodes, nproc, "cuda" if gpus else "cpu", None if gpus else []
    if launcher.name != "local":
        raise ConfigError(f"launcher.name={launcher.name} is not one of local, slurm; pick launcher=local or "
                          f"launcher=slurm")
    _refuse_slurm_keys(launcher)
    fewest, nnodes = local_nodes(cfg)
    found = visible_gpus() if device != "cpu" else []  # no CUDA context here (launcher/launch/gpus.py)
    gpus = len(found)
    if device == "cuda" and not gpus:
        raise ConfigError("launcher.device=cuda but this node has no visible GPU (NVML, or torch.cuda.device_count(), says "
                          "0); use launcher.device=auto or launcher.device=cpu")
    device = device if device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cpu":  # the GPUs, if any, are hidden from these workers
        return fewest, nnodes, launcher.nproc_per_node or 2, "cpu", []
    nproc = launcher.nproc_per_node or gpus
    if nproc > gpus:
        raise ConfigError(f"launcher.nproc_per_node={nproc} but this node has {gpus} GPU(s); "
                          f"set launcher.nproc_per_node<={gpus}, or launcher.device=cpu for CPU workers")
    return fewest, nnodes, nproc, "cuda", [gpu.capability for gpu in found[:nproc]]


def _refuse_slurm_keys(launcher: DictConfig) -> None:
    """What a local launch would not ask for (launcher.partition=gpu without launcher=slurm would train here)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LauncherConfig)}
    for key in SLURM_RESOURCE_KEYS:
        value = launcher[key]
        if value == defaults[key]:
            continue
        if key in ("dependency", "after"):
            raise ConfigError(f"launcher.{key} orders Slurm jobs; add launcher=slurm, or drop launcher.{key}")
        shown = str(value).lower() if isinstance(value, bool) else value
        hint = {"nodes": " (launcher=local on several machines: launcher.nnodes)",
                "gpus_per_node": " (launcher=local: launcher.nproc_per_node)"}.get(key, "")
        raise ConfigError(f"launcher.{key}={shown} is for Slurm, and launcher=local would train on this machine "
                          f"without it; add launcher=slurm, or drop launcher.{key}{hint}")


def _choose(cfg: DictConfig, device_type: str, capabilities: list[tuple[int, int]] | None, nnodes: int) -> dict[str, Any]:
    """precision=auto and train.compile=auto for this hardware (see launcher/derived.py), and the explicit
    precision checked against it; what auto chose."""
    precision = getattr(cfg.precision.name, "value", cfg.precision.name)  # Enum when typed
    # Compute capability, not torch.cuda.is_bf16_supported(): that counts emulation (True on a V100), and
    # finds it out by putting a tensor on the GPU, a CUDA context this process would hold for the whole run.
    if precision == "bf16" and capabilities and min(capabilities) < (8, 0):
        raise ConfigError("precision=bf16 needs an Ampere or newer GPU; use precision=fp16 here, or precision=auto")
    chosen: dict[str, Any] = {}
    if precision == "auto" and capabilities is not None:
        chosen["precision"] = auto_precision(device_type, capabilities)
    compile_, strategy = cfg.train.compile, getattr(cfg.strategy.name, "value", cfg.strategy.name)
    if compile_ not in (True, False, "auto"):
        raise ConfigError(f"train.compile={compile_} is not one of true, false, auto")
    if compile_ == "auto":  # strategy=fsdp compiles its blocks only when told: not yet measured on a GPU
        chosen["compile"] = device_type == "cuda" and strategy == "ddp"
    whole_model = not compiles_each_block(strategy, cfg.train.compile_scope)  # (DDP's graph: one, or cut)
    if whole_model and cfg.train.compile_ddp_split is None and chosen.get("compile", compile_) is True:
        chosen["compile_ddp_split"] = auto_ddp_split(nnodes)
    return chosen


def local_nodes(cfg: DictConfig) -> tuple[int, int]:
    """(fewest, most) nodes of launcher.nnodes (N, or MIN:MAX for elastic), checked: more than one node
    needs an endpoint every node reaches (torchrun would otherwise make each node a world of its own)."""
    _require_positive(cfg, "launcher.rdzv_timeout_s")
    launcher, nodes = cfg.launcher, str(cfg.launcher.nnodes)
    found = re.fullmatch(r"(\d+)(?::(\d+))?", nodes)
    fewest, most = (int(found.group(1)), int(found.group(2) or found.group(1))) if found else (0, 0)
    if not 1 <= fewest <= most:
        raise ConfigError(f"launcher.nnodes={nodes} is not a number of nodes N >= 1 or MIN:MAX (1 <= MIN <= MAX)")
    if most > 1 and not launcher.rdzv_endpoint:
        raise ConfigError(f"launcher.nnodes={nodes} needs launcher.rdzv_endpoint=<host>:<port> that every "
                          f"node reaches (e.g. the first node's address and a free port)")
    endpoint = launcher.rdzv_endpoint
    if endpoint and not re.fullmatch(r"[^\s:/]+:\d{1,5}", str(endpoint)):
        raise ConfigError(f"launcher.rdzv_endpoint={endpoint} is not <host>:<port>; e.g. node001:29400")
    rank = launcher.node_rank
    if rank is not None and (fewest != most or not 0 <= rank < most):
        raise ConfigError(f"launcher.node_rank={rank} needs a fixed launcher.nnodes greater than it (it is {nodes}); "
                          f"give node ranks 0..N-1, or drop launcher.node_rank for an elastic c10d rendezvous")
    return fewest, most


def make_plan(cfg: DictConfig) -> Plan:
    """Check the config against where it will run and derive the plan, or raise ConfigError."""
    _require_positive(cfg, "train.global_batch_size", "train.max_micro_batch_size", "train.log_every",
                      "launcher.nproc_per_node", "dist.timeout_s", "dist.hang_timeout_s", "dist.startup_timeout_s",
                      "dist.checkpoint_timeout_s", "train.straggler_ratio", "optimizer.lr", "train.max_grad_norm",
                      "train.keep_checkpoints", "train.max_bad_steps", "launcher.shutdown_timeout_s",
                      "train.prefetch_factor")
    workers = cfg.train.num_workers
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ConfigError(f"train.num_workers={workers} is neither an integer >= 0 nor auto")
    for key in ("train.max_steps", "train.eval_every", "train.ckpt_every", "scheduler.warmup_steps",
                "launcher.max_restarts"):  # train.max_steps=0: evaluate model.pretrained, train nothing
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 0")
    if not 0 <= cfg.scheduler.min_lr_ratio <= 1:  # below 0 the decayed lr turns negative: training goes backwards
        raise ConfigError(f"scheduler.min_lr_ratio={cfg.scheduler.min_lr_ratio} is not in 0..1 (the final lr is "
                          f"optimizer.lr times it); e.g. 0.1, or 0 to decay to zero")
    if not 0 <= cfg.train.seed < 2**32:  # numpy's range, and the ranks' seeds (data.rank_seed) fit torch's 64 bits
        raise ConfigError(f"train.seed={cfg.train.seed} is not in 0..{2**32 - 1}; pick a seed in that range")
    if signal_named(cfg.launcher.signal) in (None, signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"launcher.signal={cfg.launcher.signal} is not a signal that can be caught; "
                          f"use USR2 (the default), USR1 or TERM")
    fewest, nnodes, nproc, device_type, capabilities = _shape(cfg)
    auto = _choose(cfg, device_type, capabilities, nnodes)
    _require_one_of(cfg, "train.sync_check", None, "warn", "error")
    _require_one_of(cfg, "train.best_mode", None, "max", "min")
    if cfg.train.best_mode and not cfg.train.best_metric:
        raise ConfigError(f"train.best_mode={cfg.train.best_mode} has no effect without train.best_metric (an eval "
                          f"metric, e.g. accuracy)")
    # the one eval at the end: its checkpoint is the last one anyway (train.max_steps=0 keeps none)
    if cfg.train.best_metric and not cfg.train.eval_every and cfg.train.max_steps:
        raise ConfigError(f"train.best_metric={cfg.train.best_metric} needs evals during the run: set "
                          f"train.eval_every (it is 0: only the final eval), or drop train.best_metric")
    _require_one_of(cfg, "dist.comm_hook", None, "fp16", "bf16")
    _require_one_of(cfg, "dist.backend", "auto", "gloo", "nccl")
    backend = cfg.dist.backend
    if backend == "nccl" and device_type == "cpu":
        raise ConfigError("dist.backend=nccl needs GPUs and this run has none; use dist.backend=auto")
    if cfg.dist.comm_hook == "bf16" and device_type == "cpu":
        raise ConfigError("dist.comm_hook=bf16 needs GPUs with NCCL; use dist.comm_hook=fp16 (or null) here")
    world_size = nnodes * nproc
    _check_profile(cfg.train.profile, list(cfg.train.profile_ranks), cfg.train.max_steps, world_size)
    # elastic: every world the run may go on with must divide the batch (the last one is this plan's)
    accumulations = {nodes * nproc: _accumulation(cfg, nodes * nproc) for nodes in range(fewest, nnodes + 1)}
    _check_compile(cfg.train, auto.get("compile", cfg.train.compile), accumulations, device_type)
    check_strategy(cfg, device_type, auto.get("compile", cfg.train.compile) is True, accumulations, nproc)
    return Plan(nnodes=nnodes, nproc_per_node=nproc, world_size=world_size,
                grad_accum_steps=accumulations[world_size], device_type=device_type,
                min_nnodes=fewest if fewest < nnodes else None, auto=auto or None)


def _check_compile(train: DictConfig, compiles: bool, accumulations: dict[int, int | None], device_type: str) -> None:
    """train.compile_* only when the model compiles; CUDA-graph modes only without accumulation, in every
    world size the run may have (accumulations: world size -> micro-batches per step, None for auto)."""
    mode = train.compile_mode
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile_mode={mode} is not one of null, {', '.join(COMPILE_MODES)}")
    if train.compile_scope not in (None, "model", "block"):
        raise ConfigError(f"train.compile_scope={train.compile_scope} is not one of null, model, block")
    if not compiles:
        why = "without train.compile=true"
        if train.compile == "auto":  # auto compiles strategy=ddp on GPUs (fsdp compiled: not yet measured there)
            why = "train.compile=auto compiles only on GPUs" if device_type != "cuda" else \
                "train.compile=auto leaves strategy=fsdp eager"
        for key, unset in (("compile_mode", None), ("compile_dynamic", None), ("compile_fullgraph", False),
                           ("compile_ddp_split", None), ("compile_scope", None)):
            if train[key] != unset:
                value = str(train[key]).lower() if isinstance(train[key], bool) else train[key]
                raise ConfigError(f"train.{key}={value} has no effect: {why}; add train.compile=true or drop "
                                  f"train.{key}")
    world, accumulation = next(((w, k) for w, k in accumulations.items() if k != 1), (None, 1))
    if mode in CUDA_GRAPH_MODES and accumulation != 1:
        # CUDA graphs overwrite their outputs at the next replay, gradients of earlier micro-batches too
        fix = ("set train.micro_batch_size to global_batch_size / world size (one micro-batch per step)"
               if len(accumulations) == 1 else "use a fixed launcher.nnodes with one micro-batch per step")
        raise ConfigError(f"train.compile_mode={mode} captures CUDA graphs, which break gradient accumulation "
                          f"(pytorch#169545), and with {world} ranks this run accumulates "
                          f"{'an automatic number of' if accumulation is None else accumulation} micro-batches per "
                          f"step; {fix}, or use train.compile_mode=max-autotune-no-cudagraphs")


def _accumulation(cfg: DictConfig, world_size: int) -> int | None:
    """K from the configured micro-batch; None for auto, where the workers find the micro-batch."""
    train, micro = cfg.train, cfg.train.micro_batch_size
    if micro != "auto" and (not isinstance(micro, int) or isinstance(micro, bool) or micro <= 0):
        raise ConfigError(f"train.micro_batch_size={micro} is neither a positive integer nor auto")
    if micro != "auto":
        return grad_accum_steps(train.global_batch_size, micro, world_size)
    if train.global_batch_size % world_size:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} is not divisible by the world size "
                          f"{world_size}; with train.micro_batch_size=auto every rank needs the same share: set "
                          f"train.global_batch_size to a multiple of {world_size}")
    if cfg.dist.static_graph:  # DDP's static graph cannot drop a step whose forward ran (see micro_batch.py)
        raise ConfigError("train.micro_batch_size=auto redoes a step after running out of memory, which "
                          "dist.static_graph=true cannot; set dist.static_graph=false or a fixed train.micro_batch_size")
    return None


def _check_profile(steps: Any, ranks: list[int], max_steps: int, world_size: int) -> None:
    if steps is None:
        return
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= max_steps:
        raise ConfigError(f"train.profile={list(steps)} is not [first, last] steps with 1 <= first <= last <= "
                          f"train.max_steps={max_steps}; e.g. train.profile=[10,12]")
    if not ranks or any(not 0 <= r < world_size for r in ranks):
        raise ConfigError(f"train.profile_ranks={ranks} must name ranks of this run (0..{world_size - 1})")


def resolve(cfg: DictConfig, plan: Plan) -> dict[str, Any]:
    """The fully resolved config plus the plan: the only thing workers read."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
    except Exception as err:  # omegaconf names the key on a later line of its message
        key = re.search(r"full_key: (\S+)", str(err))
        if key and "Missing mandatory value" in str(err):
            raise ConfigError(f"{key.group(1)} is required (it is ??? in the config); set {key.group(1)}=...") from None
        where = f"{key.group(1)}: " if key else ""
        raise ConfigError(f"cannot resolve the config: {where}{str(err).splitlines()[0]}") from None
    for key, value in (plan.auto or {}).items():  # workers read what auto chose, as if it had been set
        container["precision" if key == "precision" else "train"]["name" if key == "precision" else key] = value
    container["plan"] = asdict(plan)
    return container


def write_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """Write <run_dir>/config.yaml atomically (temp file + rename), so no worker reads half a file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    write_atomically(path, OmegaConf.to_yaml(OmegaConf.create(config)))
    return path
