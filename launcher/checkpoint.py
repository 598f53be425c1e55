"""Complete checkpoints only: written to a temp dir, fsynced, renamed to checkpoints/<step>/, marked.

Model weights are safetensors (loadable without unpickling); the rest is a plain torch file.
Exercised by: `python -m launcher +exp=toy` (look at <run_dir>/checkpoints/).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_model

MARKER = "COMPLETE"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: Path, step: int, model: torch.nn.Module, train_state: dict[str, Any], is_main: bool) -> Path:
    """Every rank calls this; rank 0 writes, and the barrier keeps all ranks until the files are there."""
    root = run_dir / "checkpoints"
    final = root / str(step)
    if is_main:
        tmp = root / f".tmp-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(model, str(tmp / "model.safetensors"))  # handles tied weights
        torch.save(train_state, tmp / "train_state.pt")
        (tmp / MARKER).write_text(json.dumps({"step": step}) + "\n")
        for item in (*tmp.iterdir(), tmp):
            _fsync(item)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: a reader sees no dir or a complete one
        _fsync(root)
    dist.barrier()
    return final
