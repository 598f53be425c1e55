"""strategy=ddp / strategy=fsdp checked in the parent: the other's keys, what fsdp cannot do, train.compile_scope.

Exercised by: tests/test_fsdp.py (`python -m launcher +exp=toy strategy=fsdp dist.comm_hook=fp16`: refused).
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig

from launcher.compat import FSDP2_ON_CPU
from launcher.derived import CUDA_GRAPH_MODES, ConfigError
from launcher.train.sharding import shard_size

# DDP's own keys (conf: dist.*) with their defaults: under strategy=fsdp a changed one would do nothing
DDP_KEYS = {"bucket_cap_mb": None, "gradient_as_bucket_view": True, "static_graph": False,
            "find_unused_parameters": False, "comm_hook": None}


def check_strategy(cfg: DictConfig, device_type: str, compiles: bool, accumulations: dict[int, int | None],
                   nproc_per_node: int) -> None:
    """Raise ConfigError for a strategy key that would do nothing, or an fsdp run this launcher cannot train
    (`compiles`: what train.compile, after auto, says; `accumulations`: every world size the run may have, and its
    micro-batches a step, None for train.micro_batch_size=auto)."""
    strategy = cfg.strategy
    name = getattr(strategy.name, "value", strategy.name)  # Enum when typed
    scope = cfg.train.compile_scope
    if name == "ddp":
        for key in ("reshard_after_forward", "reduce_every_micro_batch", "shard_size", "meta_init"):
            if strategy[key] is not None:
                raise ConfigError(f"strategy.{key}={str(strategy[key]).lower()} has no effect with strategy=ddp; "
                                  f"add strategy=fsdp, or drop strategy.{key}")
        if strategy.block is not None and not (compiles and scope == "block"):
            raise ConfigError(f"strategy.block={strategy.block} has no effect with strategy=ddp unless "
                              f"train.compile_scope=block compiles the blocks; add strategy=fsdp or "
                              f"train.compile_scope=block, or drop strategy.block")
        if scope == "block" and cfg.train.compile_ddp_split is not None:
            raise ConfigError(f"train.compile_ddp_split={str(cfg.train.compile_ddp_split).lower()} cuts the whole "
                              f"model's graph, and train.compile_scope=block compiles each block (DDP all-reduces "
                              f"as their backwards end): drop one of them")
        return
    if scope == "model":
        raise ConfigError("train.compile_scope=model: strategy=fsdp compiles each block (FSDP2 gathers the weights "
                          "between them); drop train.compile_scope, or use strategy=ddp")
    if device_type == "cpu" and not FSDP2_ON_CPU:
        raise ConfigError(f"strategy=fsdp on CPU workers needs torch 2.7 or newer (FSDP2 records events on the CPU's "
                          f"stream, pytorch#145935), and this is torch {torch.__version__}: upgrade torch, or use "
                          f"strategy=ddp")
    if compiles and cfg.train.compile_ddp_split is not None:
        raise ConfigError(f"train.compile_ddp_split={cfg.train.compile_ddp_split} is DDP's graph split; strategy=fsdp "
                          f"compiles each block: drop it, or use strategy=ddp")
    if compiles and cfg.train.compile_mode in CUDA_GRAPH_MODES:  # FSDP2's hooks run between the compiled blocks
        raise ConfigError(f"train.compile_mode={cfg.train.compile_mode} captures CUDA graphs, which FSDP2's gathers "
                          f"between the blocks break; use train.compile_mode=max-autotune-no-cudagraphs, or "
                          f"strategy=ddp")
    for world in accumulations:  # (elastic: each one the run may go on with)
        shard_size(strategy.shard_size, world, nproc_per_node)
    if strategy.reduce_every_micro_batch and set(accumulations.values()) == {1}:
        raise ConfigError(f"strategy.reduce_every_micro_batch=true has no effect with one micro-batch a step "
                          f"(train.micro_batch_size={cfg.train.micro_batch_size} of train.global_batch_size="
                          f"{cfg.train.global_batch_size}: no accumulation); drop it, or lower train.micro_batch_size")
    for key, default in DDP_KEYS.items():
        if cfg.dist[key] != default:
            raise ConfigError(f"dist.{key}={cfg.dist[key]} is DDP's and has no effect with strategy=fsdp; drop it, "
                              f"or use strategy=ddp")
    if cfg.optimizer.get("fused") and str(cfg.optimizer.get("_target_")).endswith(".SGD"):
        raise ConfigError("optimizer.fused=true: torch's sharded tensors (DTensor, which strategy=fsdp trains) have no "
                          "rule for fused SGD's kernel; drop optimizer.fused (torch's default, foreach on GPUs), or use "
                          "strategy=ddp")
