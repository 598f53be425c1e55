"""train.ckpt_async: a checkpoint copied to host memory at its step, written by a thread while training goes on.

Rank 0 copies the weights and the train state (the optimizer's moments too: the next step changes them in place)
into host buffers it keeps from save to save, pinned on CUDA: there the copies are queued on the GPU behind the
step, and the thread, not the training, waits for them. The thread then writes exactly what a synchronous save
writes (launcher/train/checkpoint.py: temp dir, checksums, COMPLETE, rename), so a crash at any instant leaves the
newest complete checkpoint, never a torn one that counts. A save waits for the one before it; the final save and
a preemption's wait for their own. Exercised by: tests/test_background_save.py.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch


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

    def start(self, step: int, model: torch.nn.Module, train_state: dict[str, Any],
              write: Callable[[HostWeights, dict[str, Any]], None]) -> None:
        """Wait for the save before (raising its error), copy this step's state, and write it in a thread."""
        self.wait()
        shared: dict[tuple, torch.Tensor] = {}  # tied weights (an embedding and its decoder) stay one copy
        weights = HostWeights({name: self._host(f"model/{name}", tensor, shared)
                               for name, tensor in model.state_dict().items()})
        state = self._copy(train_state, "state", shared)
        ready = None
        if self.device.type == "cuda":  # the copies are queued behind the step: the thread waits for them
            ready = torch.cuda.Event()
            ready.record()
        self._step = step
        # not a daemon: an error that ends the worker still lets Python finish the write before it exits
        self._thread = threading.Thread(target=self._write, args=(write, weights, state, ready),
                                        name=f"launcher-checkpoint-{step}")
        self._thread.start()

    def wait(self) -> None:
        """Until the save in flight is complete; its error is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the checkpoint of step {self._step}, written in the background, failed: "
                               f"{type(error).__name__}: {error}") from error

    def _write(self, write: Callable[[HostWeights, dict[str, Any]], None], weights: HostWeights,
               state: dict[str, Any], ready: torch.cuda.Event | None) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            write(weights, state)
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
        """A host copy of `tensor` in the buffer kept for `place` (queued on the GPU for a CUDA tensor)."""
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype)
        if key in shared:
            return shared[key]
        buffer = self._buffers.get(place)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
            self._buffers[place] = buffer
        buffer.copy_(tensor.detach(), non_blocking=True)
        shared[key] = buffer
        return buffer
