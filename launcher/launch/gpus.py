"""The node's visible GPUs (name, compute capability) and driver, read through NVML without a CUDA context.

The parent decides the plan (how many workers, precision auto) before any worker starts. torch.cuda's
get_device_capability and get_device_name initialise CUDA in the parent, which then holds a context (and
hundreds of MB of GPU memory) for the whole run, and `nvidia-smi` costs a process start: NVML (libnvidia-ml,
shipped with the driver, the library torch.cuda.device_count itself reads) answers both at once. Without NVML, or
where it cannot say (no driver, a MIG slice or a GPU in MIG mode, a build without it) torch.cuda answers instead.
CUDA_VISIBLE_DEVICES narrows the list as CUDA does: the entries up to the first one that names no GPU (a GPU
named twice: none). On a node of mixed GPUs NVML's order (PCI bus) is CUDA's only with
CUDA_DEVICE_ORDER=PCI_BUS_ID; without it torch.cuda answers there too.
Exercised by: tests/test_fast_defaults.py (CUDA_VISIBLE_DEVICES, the fallback; NVML against torch under -m gpu).
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]


def visible_gpus() -> list[Gpu]:
    """The GPUs this node's workers will see, in CUDA's numbering."""
    found = _nvml_gpus()
    return found if found is not None else _torch_gpus()


def driver_version() -> str | None:
    """The NVIDIA driver's version, or None (no driver, no NVML)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        text = ctypes.create_string_buffer(96)
        return text.value.decode() if nvml.nvmlSystemGetDriverVersion(text, 96) == 0 else None
    finally:
        nvml.nvmlShutdown()


def visible_indices(variable: str | None, count: int, uuids: list[str]) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as NVML indices, as CUDA reads it: integers (an entry's leading digits, as C's strtoul
    reads them: `1gpu` is 1, as torch.cuda models it) and GPU-<uuid> (prefixes too) up to the first entry that names
    no GPU; a GPU named twice before it leaves none; None where NVML cannot say (a MIG slice)."""
    if variable is None:
        return list(range(count))
    indices: list[int] = []
    for entry in (e.strip() for e in variable.split(",")):
        if entry.startswith("MIG-"):
            return None
        if entry.startswith("GPU-"):
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            index = matches[0] if len(matches) == 1 else -1
        else:
            number = re.match(r"[+-]?\d+", entry)
            index = int(number.group()) if number else -1
        if index in indices:
            return []
        if not 0 <= index < count:
            break
        indices.append(index)
    return indices


def in_cuda_order(every: list[Gpu], uuids: list[str], env: Mapping[str, str]) -> list[Gpu] | None:
    """The GPUs CUDA_VISIBLE_DEVICES leaves, from NVML's list (PCI bus order), or None where CUDA's order may differ:
    by default (CUDA_DEVICE_ORDER=FASTEST_FIRST) CUDA puts the fastest GPU first, so on a node of mixed GPUs its
    device 0 need not be NVML's, and the workers' capabilities are then torch.cuda's to say."""
    if env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(set(every)) > 1:
        return None
    indices = visible_indices(env.get("CUDA_VISIBLE_DEVICES"), len(every), uuids)
    return None if indices is None else [every[index] for index in indices]


def _nvml() -> ctypes.CDLL | None:
    """The initialised NVML library (the caller shuts it down), or None."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return nvml if nvml.nvmlInit_v2() == 0 else None


def _nvml_gpus() -> list[Gpu] | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        handles, uuids = [], []
        for index in range(count.value):
            handle, uuid = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or \
                    nvml.nvmlDeviceGetUUID(handle, uuid, 96) != 0:
                return None
            handles.append(handle)
            uuids.append(uuid.value.decode())
        every = []
        for handle in handles:
            name, major, minor = ctypes.create_string_buffer(96), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetName(handle, name, 96) != 0 or nvml.nvmlDeviceGetCudaComputeCapability(
                    handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                return None
            every.append(Gpu(name.value.decode(), (major.value, minor.value)))
            current, pending = ctypes.c_uint(), ctypes.c_uint()  # MIG on: a CUDA process sees one slice, not
            if nvml.nvmlDeviceGetMigMode(handle, ctypes.byref(current), ctypes.byref(pending)) == 0 and current.value:
                return None  # the GPUs NVML counts (each worker but the first would find no GPU): torch answers
        return in_cuda_order(every, uuids, os.environ)
    except AttributeError:  # an NVML older than these calls
        return None
    finally:
        nvml.nvmlShutdown()


def _torch_gpus() -> list[Gpu]:
    """torch.cuda's answer (it initialises CUDA in this process); none where CUDA does not work."""
    try:
        return [Gpu(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver is the workers' problem to report, not a reason to stop here
        return []
