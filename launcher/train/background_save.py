"""train.ckpt_async: a checkpoint copied to host memory at its step, written by a thread while training goes on.

Rank 0 copies the weights and the train state (the optimizer's moments too: the next step changes them in place)
into host buffers it keeps from save to save (under strategy=fsdp the weights it gathered are host copies already),
and under strategy=fsdp every rank its shards of the moments (launcher/train/sharded_checkpoint.py), pinned on
CUDA: there the copies are queued on the GPU behind the step, and the thread, not the training, waits for them (they
are queued once the ranks agreed that each could make its buffers: that agreement, on NCCL, would wait for them).
The thread then writes exactly what a synchronous save writes (launcher/train/checkpoint.py: temp dir, checksums,
COMPLETE, rename), so a crash at any instant leaves the newest complete checkpoint, never a torn one that counts.
A save waits for the one before it; the final save and a preemption's wait for their own. Exercised by:
tests/test_background_save.py.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch

from launcher.train import sharded_checkpoint


class HostWeights:
    """What safetensors' save_model reads of a module, its state_dict, as host copies tied as the module's are."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


class BackgroundSave:
    """Rank 0's writer of checkpoints in the background: at most one in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}  # by the tensor's place in the state: reused by every save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        self._pending: tuple | None = None  # what prepare() made, for go()
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, the tensor it copies)

    def prepare(self, step: int, model: torch.nn.Module | HostWeights | None, train_state: dict[str, Any] | None,
                write: Callable[[HostWeights | None, dict[str, Any] | None, dict[str, Any] | None], None],
                moments: dict[str, Any] | None = None) -> None:
        """Wait for the save before (raising its error) and make this step's host buffers; what may fail, before the
        ranks agree that every one can save (checkpoint.py), which go() then starts. Under strategy=fsdp the ranks
        but rank 0 have only `moments`, their shards (model and train_state None), and rank 0's `model` is the
        weights it gathered (sharding.full_weights): host copies of their own, written as they are (the caller keeps
        none of them). Nothing is copied yet: on CUDA the ranks' agreement (NCCL) would wait for the copies."""
        self.wait()
        self._copies = []
        shared: dict[tuple, torch.Tensor] = {}  # tied weights (an embedding and its decoder) stay one copy
        if model is None or isinstance(model, HostWeights):
            weights = model
        else:
            weights = HostWeights({name: self._host(f"model/{name}", tensor, shared)
                                   for name, tensor in model.state_dict().items()})
        state = None if train_state is None else self._copy(train_state, "state", shared)
        shards = None if moments is None else {key: sharded_checkpoint.on_host(value, self._host(
            f"moments/{key}", value.to_local(), shared)) for key, value in moments.items()}
        self._step, self._pending = step, (write, weights, state, shards)

    def go(self) -> None:
        """Once every rank prepared: copy the state (queued on the GPU behind the step, where the thread waits for
        it) and write it in a thread. An error here is the next wait's, as the write's is (the ranks agreed)."""
        if self._pending is None:  # (a rank with nothing to write: DDP's ranks but rank 0)
            return
        (write, weights, state, shards), self._pending = self._pending, None
        copies, self._copies = self._copies, []
        try:
            for buffer, tensor in copies:
                buffer.copy_(tensor.detach(), non_blocking=True)
            ready = None
            if self.device.type == "cuda":  # the copies are queued behind the step: the thread waits for them
                ready = torch.cuda.Event()
                ready.record()
            # not a daemon: an error that ends the worker still lets Python finish the write before it exits
            thread = threading.Thread(target=self._write, args=(write, weights, state, shards, ready),
                                      name=f"launcher-checkpoint-{self._step}")
            thread.start()
            self._thread = thread  # (one that did not start is none to join)
        except Exception as error:  # noqa: BLE001 - raised by the next wait(), on every rank
            self._error = error

    def finish(self) -> None:
        """Until the save in flight is written, its error left to the next wait (a run ending with an error of its
        own: the write needs the process groups, which the worker's exit takes down after this)."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Until the save in flight is complete; its error is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the checkpoint of step {self._step}, written in the background, failed: "
                               f"{type(error).__name__}: {error}") from error

    def _write(self, write: Callable[[HostWeights | None, dict[str, Any] | None, dict[str, Any] | None], None],
               weights: HostWeights | None, state: dict[str, Any] | None, shards: dict[str, Any] | None,
               ready: torch.cuda.Event | None) -> None:
        try:
            if self.device.type == "cuda":  # a new thread's current device is GPU 0, whatever the rank's
                torch.cuda.set_device(self.device)
            if ready is not None:
                ready.synchronize()
            write(weights, state, shards)
        except BaseException as error:  # noqa: BLE001 - raised by the next wait(), on the training thread
            self._error = error

    def _copy(self, value: Any, place: str, shared: dict[tuple, torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._host(place, value, shared)
        if isinstance(value, dict):
            return {key: self._copy(item, f"{place}/{key}", shared) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, f"{place}/{i}", shared) for i, item in enumerate(value))
        return copy.deepcopy(value)  # (numbers, strings: the scheduler's lists are replaced, but not shared)

    def _host(self, place: str, tensor: torch.Tensor, shared: dict[tuple, torch.Tensor]) -> torch.Tensor:
        """The buffer kept for `place`, which go() fills with `tensor` (queued on the GPU for a CUDA tensor)."""
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype)
        if key in shared:
            return shared[key]
        buffer = self._buffers.get(place)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
            self._buffers[place] = buffer
        self._copies.append((buffer, tensor))
        shared[key] = buffer
        return buffer
