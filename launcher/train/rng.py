"""Every rank's random state, as a checkpoint keeps it: CPU generators, and the CUDA generator of the rank's GPU.

Exercised by: tests/test_resume.py (an exact resume under dropout).
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's random state: CPU generators, and the CUDA generator of its own GPU only (a rank may
    see other GPUs, and after a change of node shape the same rank index sits on another one)."""
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_name, np_keys.tolist(), np_pos, np_gauss, np_cached]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, gauss, cached))
    if device.type == "cuda" and "cuda" in state:  # a CPU run's checkpoint has none: CUDA's stays seeded
        cuda = state["cuda"]
        if isinstance(cuda, list):  # an older launcher's checkpoint: every visible GPU's state, by index
            cuda = cuda[device.index] if device.index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
