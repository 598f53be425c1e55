"""Process-group setup from the env:// variables, and the few collectives the loop uses.

Every worker reads only RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so torchrun,
Slurm and the tests all start it the same way. Exercised by: `python -m launcher +exp=toy`.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from launcher.compat import SET_PG_TIMEOUT
from launcher.derived import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def why_no_gpu() -> str:
    """What CUDA says when this process sees no GPU at all, though the parent's NVML counted some: a driver older
    than this torch's CUDA, a torch built without CUDA (torch.cuda.device_count() only warns, or says nothing)."""
    try:
        torch.cuda.init()
    except Exception as error:  # AssertionError (no CUDA build), RuntimeError (the driver's): CUDA's reason
        return f"; torch.cuda says: {str(error).strip().splitlines()[0][:300]}" if str(error).strip() else ""
    return ""


def init(device_type: str, backend: str, timeout_s: float) -> DistEnv:
    """Join the process group named by the env:// variables (torchrun sets them), on the plan's device.

    The device comes from the plan (`launcher.device`), never from what this process happens to see: a
    CPU plan stays on the CPU on a GPU host, and a CUDA plan uses the GPU of its local rank.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"local rank {local_rank} has no GPU: this process sees {count} (CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}){'' if count else why_no_gpu()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = _TIMEOUT[0] = timedelta(seconds=timeout_s)
    # The timeout turns a rank that never enters a collective into an error, not a 30-minute hang.
    dist.init_process_group(backend, store=_attempt_store(rank, world_size, timeout), rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The env:// store, with keys prefixed by torchrun's restart count.

    After an elastic restart the agent's store still holds the previous attempt's peer addresses, and
    the new workers would dial dead ones ("Connection refused", pytorch#167288).
    """
    on_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not on_agent and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"launcher/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown() -> None:
    """Leave the process group, once the caller has dropped its DDP model.

    A DDP reducer still alive when the interpreter exits sometimes aborts a process that finished
    cleanly ("terminate called without an active exception"; torch 2.13 + gloo, 5 of 75 exits of a
    minimal DDP script here, 0 of 90 when the model was collected first).
    """
    gc.collect()  # DDP's hooks form reference cycles: collect them while Python is fully alive
    # torch 2.6's ~ProcessGroupGloo takes the group's lock holding the GIL, while gloo's thread may still be
    # dropping a finished collective whose tensors Python let go of, which needs the GIL: a deadlock (once in
    # CI's floor run; py-spy: ~ProcessGroupGloo in pthread_mutex_lock, gloo's runLoop in gil_scoped_acquire).
    # A sleep hands that thread the GIL first. pytorch#154976 (merged June 2025: torch 2.8 by its date) makes the
    # group's destructor release the GIL, which ends the deadlock there; the floor, 2.6, still needs the sleep.
    time.sleep(0.1)
    dist.destroy_process_group()


def startup_timeout_s(startup_s: float, training_s: float) -> float:
    """The process group's timeout until the first step is done (see training_timeout)."""
    return startup_s if SET_PG_TIMEOUT else training_s


def training_timeout(timeout_s: float, *groups: dist.ProcessGroup | None) -> None:
    """Start-up is over: from now on a collective that waits longer than timeout_s fails (every rank), in the
    main group, in the groups that follow it (follow_main_timeout) and in `groups` (None: none)."""
    _TIMEOUT[0] = timedelta(seconds=timeout_s)
    if SET_PG_TIMEOUT:
        for group in (None, *_FOLLOWING, *(g for g in groups if g is not None)):
            SET_PG_TIMEOUT(_TIMEOUT[0], group)


_TIMEOUT = [timedelta(minutes=30)]  # the main group's timeout now: dist.startup_timeout_s, then dist.timeout_s
_FOLLOWING: list[dist.ProcessGroup] = []  # groups torch made for this process, whose timeout is the main group's


def follow_main_timeout(*groups: dist.ProcessGroup) -> None:
    """Groups torch made (hybrid sharding's mesh: its replica and shard groups) take the main group's timeout, now
    and at each change: torch gives them its default (NCCL's 10 minutes: a start-up slower than that on one node
    failed the run, and a hang went on past dist.timeout_s), and torch 2.6's split of them set the main group's own
    to it too (split_group wrote the timeout into the parent's options). Every rank, after the mesh is made."""
    _FOLLOWING.extend(groups)
    if SET_PG_TIMEOUT:
        for group in (None, *groups):
            SET_PG_TIMEOUT(_TIMEOUT[0], group)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned; stays on the device (no host sync)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def same_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers on every rank. DDP's broadcast of them before each forward is off (ranks may run different
    numbers of micro-batches), so buffers that a forward updates from its batch (BatchNorm's running statistics)
    follow each rank's own batches; the eval and the checkpoint take rank 0's, as under DDP's broadcast, so that all
    ranks evaluate one model and a resumed run goes on as the uninterrupted one. One broadcast; every rank enters.
    The buffers a checkpoint holds (not the non-persistent ones a module builds for itself: position ids, caches),
    on the parameters' device, each its own memory (not an expanded view)."""
    device = next(module.parameters()).device  # (a model trains parameters: it has one)
    kept = {id(b): b for m in module.modules() for name, b in m._buffers.items()
            if b is not None and name not in getattr(m, "_non_persistent_buffers_set", ()) and b.device == device
            and not any(stride == 0 and size > 1 for stride, size in zip(b.stride(), b.shape))}
    buffers = sorted(kept.values(), key=lambda b: -b.element_size())  # each one's bytes start aligned for it
    if not buffers or dist.get_world_size() == 1:
        return
    flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
    dist.broadcast(flat, src=0)
    offset = 0
    for b in buffers:
        size = b.numel() * b.element_size()
        b.data.copy_(flat[offset:offset + size].view(b.dtype).view_as(b))
        offset += size


def all_gather_objects(item: Any) -> list[Any]:
    """Every rank's (picklable) item, in rank order; every rank must call it."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, item)
    return gathered


def on_rank_0(work: Callable[[], Any], error_type: type[Exception] = RuntimeError,
              describe: Callable[[Exception], str] = lambda error: str(error) or type(error).__name__) -> Any:
    """work() on rank 0 (file-system reads and writes that one rank does for all), its picklable result on every
    rank; every rank must call it. Rank 0's error is every rank's, one line as `describe` says it, raised as
    `error_type` (a ConfigError stays one: a user's mistake, one line on every rank): the others would otherwise
    wait in the broadcast (other nodes' ranks until a timeout)."""
    outcome: list[Any] = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            outcome = [(True, work())]
        except Exception as error:
            said = describe(error).splitlines()[0]
            failure, outcome = error, [(False, (said, isinstance(error, ConfigError)))]
    dist.broadcast_object_list(outcome, src=0)
    done, value = outcome[0]
    if not done:
        said, mistake = value
        raise (ConfigError if mistake else error_type)(said) from failure
    return value


def every_rank(work: Callable[[], None],
               describe: Callable[[Exception], str] = lambda error: str(error) or type(error).__name__) -> None:
    """work() on every rank (each its own part of one job: a checkpoint's shards); any rank's error is every
    rank's, the lowest rank's in one line as `describe` says it, so that no rank goes on into a collective alone."""
    failure, said = None, None
    try:
        work()
    except Exception as error:
        failure, said = error, describe(error).splitlines()[0]
    first = next((line for line in all_gather_objects(said) if line is not None), None)
    if first is not None:
        raise RuntimeError(first) from failure
