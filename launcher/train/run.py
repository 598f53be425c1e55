"""The run's state: what the worker builds once (model, optimizer, plans, the run's helpers) and every part of the
loop reads, in a module below them all (the loop, the micro-batch probe, eval). Built by launcher/train/worker.py.
Exercised by: `python -m launcher +exp=toy`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: none of these at run time (the probes and eval import Run from here)
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from launcher.task import Task
    from launcher.train import compiled, micro_batch
    from launcher.train.background_save import BackgroundSave
    from launcher.train.best import Best
    from launcher.train.compile_cache import CompileCache
    from launcher.train.data import DataPlan
    from launcher.train.dist import DistEnv
    from launcher.train.metrics import RunLog
    from launcher.train.precision import Precision
    from launcher.train.profile import StepProfiler
    from launcher.train.sync_check import SyncCheck
    from launcher.train.watchdog import Watchdog


@dataclass
class Run:
    """Everything the loop needs, built once by the worker."""

    run_dir: Path
    env: DistEnv
    task: Task
    model: DDP | torch.nn.Module  # what trains: DDP around the (compiled) module, or (strategy=fsdp) the sharded module
    module: torch.nn.Module  # the module without DDP: what checkpoints and eval use (with fsdp: `model` itself)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    precision: Precision
    data_plan: DataPlan
    grad_accum_steps: int  # with train.micro_batch_size=auto: set by micro_batch.choose, halved by shrink
    micro_batch_size: int
    out_of_memory: micro_batch.OutOfMemoryAgreement  # auto: ranks agree whether one ran out (micro_batch.py)
    reduce_every_micro_batch: bool  # strategy=fsdp: each backward reduce-scatters (the gradients stay sharded)
    max_steps: int
    max_grad_norm: float | None
    timeout_s: float  # collectives once the first step is done (dist.timeout_s)
    checkpoint_timeout_s: float  # the others' wait while rank 0 writes a checkpoint (dist.checkpoint_timeout_s)
    log_every: int
    eval_every: int
    ckpt_every: int
    keep_checkpoints: int
    max_bad_steps: int
    log_samples: bool
    num_workers: int | str  # loader processes per rank, or auto (launcher/train/prefetch.py)
    persistent_workers: bool
    prefetch_factor: int
    log: RunLog
    config_hash: str
    memory_config: dict[str, Any]  # what an auto micro-batch size is found under (launcher/train/micro_batch_record.py)
    watchdog: Watchdog  # writes a hang report when the loop stands still (launcher/train/watchdog.py)
    profiler: StepProfiler  # records train.profile's steps (launcher/train/profile.py)
    compile_watch: compiled.CompileWatch  # what torch.compile compiled since the last log (launcher/train/compiled.py)
    compile_cache: CompileCache  # where compiles are kept for the run's next start (launcher/train/compile_cache.py)
    sync_check: SyncCheck  # train.sync_check: what makes a steady step wait for the GPU (launcher/train/sync_check.py)
    best: Best  # train.best_metric: the best eval so far, whose checkpoint is kept (launcher/train/best.py)
    background_save: BackgroundSave | None  # train.ckpt_async: rank 0 writes in a thread (launcher/train/background_save.py)
