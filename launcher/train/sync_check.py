"""train.sync_check: finds what makes a steady training step wait for the GPU, on the GPU and on the CPU.

A step that reads a device value on the host (.item(), bool(tensor), .cpu(), .tolist()) or runs an op
whose output shape depends on the data (boolean-mask indexing, nonzero, unique) stalls the CPU until the
GPU has caught up, so the next step's kernels are not queued while the GPU works. The check watches the
steady steps (those that neither log, evaluate nor checkpoint, after the first few) through torch's
dispatcher, so a CPU run (CI) finds these too. On CUDA, torch's own sync debug mode also catches what the
dispatcher cannot see (a blocking copy between host and GPU), and the dispatcher sees a non_blocking copy
from unpinned host memory, which CUDA may stage by waiting. A CPU run cannot tell a tensor that a GPU run
keeps on the host (the launcher marks its own reads of those host_side), nor see a copy to the GPU.
With train.compile=true the checked steps run the model eagerly: dynamo does not compile under a
dispatcher hook. `warn` logs each place once and counts; `error` stops the run at the first one.
Exercised by: tests/test_sync_check.py (gloo, real torchrun) and tests/test_gpu.py (CUDA).
"""
from __future__ import annotations

import os
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.train.dist import all_gather_objects

WARMUP_STEPS = 3  # first allocations, DDP's bucket rebuild, the optimizer's state: not steady yet

_aten = torch.ops.aten
READS_A_VALUE = "reads a device value on the host (.item(), bool(), float() or int() of a tensor)"
SHAPE_FROM_DATA = "has an output shape that depends on the data"
SYNCING_OPS: dict[object, str] = {
    _aten._local_scalar_dense.default: READS_A_VALUE,
    _aten.is_nonzero.default: READS_A_VALUE,
    _aten.equal.default: READS_A_VALUE,
    _aten.nonzero.default: SHAPE_FROM_DATA,
    _aten.masked_select.default: SHAPE_FROM_DATA,
    _aten._unique2.default: SHAPE_FROM_DATA,
    _aten.unique_dim.default: SHAPE_FROM_DATA,
    _aten.unique_consecutive.default: SHAPE_FROM_DATA,
    _aten.bincount.default: SHAPE_FROM_DATA,
}
BOOL_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
UNPINNED_COPY = ("copies unpinned host memory to the GPU with non_blocking=True, which CUDA may stage by waiting "
                 "for the GPU (and torch's own check does not see); pin the tensor first (.pin_memory())")
# Tensor methods that copy to the host: free on the CPU, so the dispatcher never sees them there
HOST_COPIES = {torch.Tensor.cpu: ".cpu()", torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()"}
_TORCH_DIR = os.path.dirname(torch.__file__)
SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode says, as warning or error
_paused = [False]


@contextmanager
def host_side() -> Iterator[None]:
    """A read the launcher makes on purpose, of a value the GPU finished long ago (launcher/train/ledger.py)."""
    _paused[0] = True
    try:
        yield
    finally:
        _paused[0] = False


def _syncing_op(func: object, args: tuple, kwargs: dict) -> str | None:
    if func in SYNCING_OPS:
        return SYNCING_OPS[func]
    if func in BOOL_INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
        return f"indexes with a boolean mask, which {SHAPE_FROM_DATA}"
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return f"repeat_interleave without output_size {SHAPE_FROM_DATA}"
    return None


def unpinned_copy_target(func: object, args: tuple, kwargs: dict) -> str | None:
    """The device type a non_blocking copy from pageable host memory goes to, if the op is one
    (`.to(device, non_blocking=True)` reaches the dispatcher as _to_copy, `.copy_(src, True)` as copy_)."""
    if func is _aten._to_copy.default:
        source, target, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
    elif func is _aten.copy_.default:
        source, target = args[1], args[0].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return None
    # An empty tensor has no memory to pin (is_pinned() is False), and copying nothing waits for nothing.
    if not non_blocking or target is None or source.device.type != "cpu" or not source.numel() or source.is_pinned():
        return None
    return torch.device(target).type


def where_called(frames: traceback.StackSummary | None = None) -> str:
    """The innermost frame outside torch, this file and the warnings module (of the stack here, or of
    `frames`): the line that asked for the sync."""
    for frame in reversed(frames or traceback.extract_stack()[:-1]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename not in (__file__, warnings.__file__):
            return f"{_shown(frame.filename)}:{frame.lineno} ({frame.name})"
    return "inside torch"


def _shown(path: str) -> str:
    """Relative to the working directory where the file is under it (jobs/toy.py), else as it is."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


class SyncCheck:
    """Counts, per place in the code, what would make a steady step wait for the GPU."""

    def __init__(self, mode: str | None, device: torch.device):
        self.mode, self.cuda = mode, device.type == "cuda"
        self.enabled = mode is not None
        self.found: dict[str, str] = {}  # place -> what it does, each place once
        self.syncs = 0
        self.checked_steps = 0
        self.last_checked = 0  # a step redone in smaller micro-batches (out of memory) is one step

    def steady(self, step: int, first_step: int, busy: bool) -> bool:
        """Whether `step` is checked: past the warm-up of this start (or resume), no log, eval or checkpoint."""
        return self.enabled and step > first_step + WARMUP_STEPS and not busy

    @contextmanager
    def watching(self, step: int, report: Callable[[str], None]) -> Iterator[None]:
        """Run one steady step under the check; `report` gets one line per new place (warn)."""
        new: list[str] = []

        def found(what: str, place: str | None = None) -> None:
            if _paused[0]:
                return
            place = place or where_called()
            self.syncs += 1
            waits = "waits for the GPU" if self.cuda else "would wait for a GPU"
            if self.mode == "error":
                raise RuntimeError(f"step {step} {waits}: {place} {what} (train.sync_check=error); move the "
                                   f"read to a log step, or set train.sync_check=warn to list them all")
            if place not in self.found:
                self.found[place] = what
                new.append(f"warning: step {step} {waits}: {place} {what} (train.sync_check=warn reports each "
                           f"place once; the summary's host_syncs counts them all)")

        self.checked_steps += step != self.last_checked
        self.last_checked = step
        with _cuda_sync_debug(self.cuda, self.mode == "error", found), _DispatchWatch(found, self.cuda), \
                (nullcontext() if self.cuda else _HostCopyWatch(found)):
            yield
        for line in new:
            report(line)

    def read(self) -> dict[str, int]:
        return {"host_syncs": self.syncs, "checked_steps": self.checked_steps}

    def summary(self) -> dict[str, int]:
        """Every rank calls it: the syncs of all ranks, and the steps each checked (the same on every rank)."""
        if not self.enabled:
            return {}
        per_rank = all_gather_objects(self.read())
        return {"host_syncs": sum(r["host_syncs"] for r in per_rank), "checked_steps": per_rank[0]["checked_steps"]}


class _DispatchWatch(TorchDispatchMode):
    """Every aten op, on any device: the reads of a value and the ops whose output shape needs the data;
    on CUDA also the non_blocking copies from unpinned host memory to the GPU."""

    def __init__(self, found: Callable[..., None], cuda: bool):
        super().__init__()
        self.found, self.cuda = found, cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        what = _syncing_op(func, args, kwargs)
        if self.cuda and what and not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            what = None  # host tensors in a CUDA run: no GPU to wait for
        if self.cuda and not what and unpinned_copy_target(func, args, kwargs) == "cuda":
            what = UNPINNED_COPY
        if not what:
            return func(*args, **kwargs)
        self.found(f"{what} [{func}]")
        if not self.cuda:
            return func(*args, **kwargs)
        with _cuda_debug_mode("default"):  # counted once: not again by torch's own check below
            return func(*args, **kwargs)


class _HostCopyWatch(TorchFunctionMode):
    """CPU runs only: a copy to the host is a no-op there, invisible to the dispatcher, yet a sync on a GPU."""

    def __init__(self, found: Callable[..., None]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if func in HOST_COPIES:
            self.found(f"copies a tensor to the host ({HOST_COPIES[func]})")
        return func(*args, **(kwargs or {}))


@contextmanager
def _cuda_debug_mode(mode: str) -> Iterator[None]:
    before = torch.cuda.get_sync_debug_mode()
    _set_cuda_debug_mode(mode)
    try:
        yield
    finally:
        _set_cuda_debug_mode(before)


def _set_cuda_debug_mode(mode: str | int) -> None:
    """Without torch's once-per-process note that the mode "is a prototype feature and does not yet detect
    all synchronizing operations": each rank printed it; the README says what the check covers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


@contextmanager
def _cuda_sync_debug(cuda: bool, error: bool, found: Callable[..., None]) -> Iterator[None]:
    """torch's own check on CUDA, for what the dispatcher cannot see (a blocking copy between host and
    GPU). Its error becomes ours, in one line; each of its warnings is reported like the rest,
    placed where it was raised (one raised in autograd's threads is replayed at the backward() call).
    Other warnings go where they would have gone."""
    if not cuda:
        yield
        return
    shown_before = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (the hook's signature)
        if SYNC_WARNING in str(message):
            found("synchronizes with the GPU", where_called())
        else:
            shown_before(message, category, filename, lineno, file, line)

    try:
        with warnings.catch_warnings(), _cuda_debug_mode("error" if error else "warn"):
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # every one, not once per line
            warnings.showwarning = show
            yield
    except RuntimeError as err:
        if SYNC_WARNING not in str(err):
            raise
        found("synchronizes with the GPU", where_called(traceback.extract_tb(err.__traceback__)))
        raise  # not reached: found() raises in error mode
