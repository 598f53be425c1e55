"""What train.micro_batch_size=auto found, kept for the run's next start: the size, why, and what it was found
under, so that a restart, a resume or a requeue goes on with it only where it still fits the same way.

A size found on an 80 GiB GPU runs out of memory on a 40 GiB one after a requeue, and one found before a change
of precision, strategy, model, data or compile settings may no longer fit (or may waste a GPU that now has room):
such a size is not kept, the next start probes again and says which setting changed. Exercised by:
tests/test_micro_batch_kept.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from launcher.derived import differing_keys
from launcher.rundir import write_atomically
from launcher.train.dist import all_gather_objects

MICRO_BATCH_FILE = "micro_batch.json"  # the auto size in force: a restart or a resume goes on with it
# train's keys that change how much memory a micro-batch takes, or which sizes are tried (the rest: cadences,
# logging, the trajectory's numbers such as max_steps, which a resume often extends)
MEMORY_TRAIN_KEYS = ("compile", "compile_mode", "compile_dynamic", "compile_fullgraph", "compile_ddp_split",
                     "compile_scope", "max_micro_batch_size")
MEMORY_DIST_KEYS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
                    "comm_hook")  # DDP's gradient buckets, made with the model
SHOWN = 4  # differing keys named in the line, then a count


def memory_config(config: dict[str, Any], world_size: int, device: torch.device) -> dict[str, Any]:
    """What a micro-batch's memory on a rank depends on: the model (activation checkpointing included), its data
    (sequence lengths), the optimizer's state, precision, strategy, DDP's buckets, compile settings, the devices,
    torch, and under strategy=fsdp the world size (each rank holds 1/world of the state; under ddp a whole copy
    at any world). Every rank calls it, and every rank gets rank 0's settings with every rank's devices and
    torch: a record any rank writes (the one that ran out) reads the same to rank 0, which judges it."""
    train, dist, strategy = (config.get(part) or {} for part in ("train", "dist", "strategy"))
    mine = {"model": config.get("model"), "data": config.get("data"), "optimizer": config.get("optimizer"),
            # (strategy.meta_init changes how the model is built on host, not what a rank holds on its device)
            "precision": config.get("precision"), "strategy": {k: v for k, v in strategy.items() if k != "meta_init"},
            "train": {key: train.get(key) for key in MEMORY_TRAIN_KEYS},
            "dist": {key: dist.get(key) for key in MEMORY_DIST_KEYS},
            "world_size": world_size if strategy.get("name") == "fsdp" else None,
            "devices": device_of(device), "torch": str(torch.__version__)}  # (a str: checkpoints load weights_only)
    everyone = all_gather_objects(mine)
    found = {**everyone[0], **{key: sorted({each[key] for each in everyone}) for key in ("devices", "torch")}}
    return json.loads(json.dumps(found))  # as micro_batch.json gives it back (a dict's int keys become strings)


def device_of(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"


def read(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / MICRO_BATCH_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write(run_dir: Path, size: int, why: str, found_under: dict[str, Any]) -> None:
    # several ranks may write the same size at once
    write_atomically(run_dir / MICRO_BATCH_FILE,
                     json.dumps({"micro_batch_size": size, "why": why, "found_under": found_under}) + "\n")


def changed(found_under: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """The settings that differ from those a kept size was found under, as `devices, model.hidden`; "" when none
    (or for a record of a launcher that did not write them: kept, as it was then)."""
    if found_under is None:
        return ""
    keys = differing_keys(found_under, now)
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
