"""strategy=fsdp's one build (strategy.meta_init): only rank 0 builds the model whole; the others build it on the
meta device and receive their rows from rank 0.

Without it every rank built the whole model in host memory (and read a pretrained one whole) before fully_shard
kept its rows: a node of 8 ranks training a 7B model in float32 held 8 x 28 GB, and read the checkpoint 8 times.
On the meta device a build allocates nothing, initialises nothing and reads no weights. Before fully_shard rank 0
broadcasts each tensor (parameters, buffers, and tensors kept in plain attributes), one at a time, and every other
rank keeps its rows; after it their shards and buffers are allocated on their device (to_empty) and filled with
those rows. The weights are rank 0's, as every rank's were the same build from the same seed: the trajectory is
the same bitwise (tests/test_meta_init.py).

A job's model build must then make the structure alone where torch.get_default_device() is meta (transformers:
from_config, not from_pretrained, which refuses the meta device: jobs/bert.py). Ranks that built different
structures, or a build that fails on the meta device, are refused on every rank with one line, before any tensor
is sent. Rank 0's build may take long (a download): the others wait for it in the first gather, within
dist.startup_timeout_s. Exercised by: tests/test_meta_init.py (and every fsdp test of more than one rank, where
it is the default).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from launcher.derived import ConfigError
from launcher.train.dist import all_gather_objects
from launcher.train.sharding import is_dtensor, rows_of

OFF = "or set strategy.meta_init=false (every rank builds the whole model)"


def in_use(strategy: Any, world_size: int) -> bool:
    """Whether rank 0 builds alone: strategy=fsdp with strategy.meta_init over more than one rank (a world of 1
    builds as DDP does)."""
    return strategy.name == "fsdp" and bool(strategy.get("meta_init")) and world_size > 1


def build(make: Callable[[], nn.Module], rank: int, group_size: int,
          device: torch.device) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Every rank (collectives): make() (the job's model), on the meta device but on rank 0, then send(): this
    rank's rows of rank 0's tensors ({} on rank 0), which receive() puts in place once the model is sharded.

    Every rank enters the one gather, whether its build failed or not, and all raise if one did (a rank left
    waiting in a collective for one that failed would add a traceback of a lost connection): a rank's own error,
    with its build on the meta device named where it failed there; the others, that rank's line."""
    empty = rank != 0
    model, error = None, None
    try:
        with torch.device("meta") if empty else nullcontext():
            model = make()
    except Exception as caught:  # (what make raises is the job's: told below, on every rank)
        error = caught
    line = None if error is None else next((text for text in str(error).splitlines() if text.strip()),
                                           type(error).__name__)
    if error is not None and empty:
        line += (" (strategy=fsdp: ranks other than 0 build the model on the meta device; a job's build makes the "
                 f"structure alone where torch.get_default_device() is meta, e.g. transformers' from_config; {OFF})")
    gathered = all_gather_objects((line, *(layout(model) if model is not None else ([], []))))
    failed = next(((r, said) for r, (said, _, _) in enumerate(gathered) if said), None)
    if error is not None and not empty:
        raise error
    if failed:
        failure = ValueError(line if error is not None else f"rank {failed[0]}'s model: {failed[1]}")
        failure.one_line = True  # the line says it all (rank 0 shows a traceback of its own fault)
        raise failure from error
    check_same_build(gathered)
    return model, send(model, rank, group_size, device, places=gathered[0][2])


def tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too, which no state_dict holds), a tied one under each
    of its names, in the module's order (the same on every rank that built the same structure)."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def layout(model: nn.Module) -> tuple[list[tuple], list[str]]:
    """What two builds must agree on: each parameter's, buffer's and plain attribute's tensor (rank 0 sends those
    too) by name, shape, dtype, requires_grad and the name it is tied to; and each plain attribute's device type
    (the others put rank 0's on their device of that type)."""
    first: dict[int, str] = {}
    attributes = plain_attributes(model)
    entries = [(name, tuple(t.shape), str(t.dtype), t.requires_grad, first.setdefault(id(t), name))
               for name, t in [*tensors(model), *((name, t) for name, _, _, t in attributes)]]
    return entries, [t.device.type for *_, t in attributes]


def plain_attributes(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(name, module, key, tensor) for each tensor a module keeps in a plain attribute, not a buffer's (those are
    the buffer again: aliases()). A build on the meta device leaves them meta, rank 0's hold values."""
    buffers = {id(b) for b in model.buffers()}
    return [(f"{prefix}.{key}".lstrip("."), module, key, value) for prefix, module in model.named_modules()
            for key, value in vars(module).items() if isinstance(value, torch.Tensor) and id(value) not in buffers]


def aliases(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, name, the buffer it is) for each further name of a buffer: one tensor
    registered in two modules, or a plain attribute that is a buffer (transformers 4's rotary embeddings keep
    original_inv_freq so). to_empty gives each registered name a tensor of its own and leaves plain attributes on
    the meta device, where rank 0 keeps one tensor: receive() points them back at the first name's."""
    first: dict[int, str] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        first.setdefault(id(buffer), name)
    found = []
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and first[id(buffer)] != f"{prefix}.{key}".lstrip("."):
                found.append((module, key, first[id(buffer)]))
        found += [(module, key, first[id(value)]) for key, value in vars(module).items()
                  if isinstance(value, torch.Tensor) and id(value) in first]
    return found


def check_same_build(gathered: list[tuple[Any, list[tuple], list[str]]]) -> None:
    """Raise ConfigError (on every rank: all hold every rank's layout) where a rank's build differs from rank 0's,
    or rank 0's keeps a plain attribute on the meta device (transformers 5 builds from_pretrained's model there:
    one of remote code may keep one), which it could not send."""
    ours, places = gathered[0][1], gathered[0][2]
    lost = [entry[0] for entry, place in zip(ours[len(ours) - len(places):], places) if place == "meta"]
    if lost:
        raise ConfigError(f"strategy=fsdp: rank 0's model keeps {', '.join(lost[:3])} on the meta device, outside its "
                          f"parameters and buffers: no rank can send it; make it a buffer (register_buffer), {OFF}")
    for rank, (_, theirs, _) in enumerate(gathered):
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise ConfigError(f"strategy=fsdp: rank {rank} built on the meta device a model unlike rank 0's "
                              f"({_said(theirs[at:])} against rank 0's {_said(ours[at:])}); the job's build must "
                              f"make the same structure there, {OFF}")


def _said(entries: list[Any]) -> str:
    """The first of a rank's tensors where two builds part, in words."""
    if not entries:
        return "no more tensors"
    name, shape, dtype, grad, tied = entries[0]
    return f"{name} {list(shape)} {dtype.removeprefix('torch.')}" + (" requires_grad=False" if not grad else "") + (
        f" tied to {tied}" if tied != name else "")


@torch.no_grad()
def send(model: nn.Module, rank: int, group_size: int, device: torch.device,
         places: list[str]) -> dict[str, torch.Tensor]:
    """Before fully_shard: rank 0 broadcasts each tensor whole, one at a time (on its way to `device`), and each
    other rank keeps its rows of a parameter (those fully_shard will give it: Shard(0) among the `group_size` ranks
    of its group, consecutive ones) and the whole of a buffer, on `device`; a plain attribute's tensor it sets at
    once, on its device of rank 0's type (`places`). Sent before sharding, so that rank 0's whole tensors go as
    fully_shard replaces them, as where every rank builds (it would hold 1 + 1/world of the model after it); the
    others hold their rows, never the whole. A tensor under several names goes once."""
    params = {id(p) for p in model.parameters()}
    sent: set[int] = set()
    mine = {}
    for name, tensor in tensors(model):
        if id(tensor) in sent:
            continue
        sent.add(id(tensor))
        incoming = _broadcast(tensor, rank, device)
        if rank:  # (a 0-dim parameter goes whole, for fully_shard to refuse in its own words)
            mine[name] = incoming[rows_of(len(incoming), group_size, rank % group_size)].clone() \
                if id(tensor) in params and incoming.dim() else incoming
    attributes: dict[int, torch.Tensor] = {}  # (one tensor of two modules: the same one again on every rank)
    for (_, module, key, value), place in zip(plain_attributes(model), places):
        if id(value) not in attributes:
            attributes[id(value)] = _broadcast(value, rank, device).to(device if place == device.type else place) \
                .requires_grad_(value.requires_grad)
        if rank:
            setattr(module, key, attributes[id(value)])
    return mine


def _broadcast(tensor: torch.Tensor, rank: int, device: torch.device) -> torch.Tensor:
    """Rank 0's `tensor`, whole, on `device` on every rank."""
    incoming = torch.empty(tensor.shape, dtype=tensor.dtype, device=device) if rank else \
        tensor.detach().to(device).contiguous()
    dist.broadcast(incoming, src=0)
    return incoming


@torch.no_grad()  # (a copy into a DTensor's local tensor under autograd is refused)
def receive(model: nn.Module, mine: dict[str, torch.Tensor], device: torch.device) -> None:
    """After fully_shard, on the ranks that built on the meta device: their shards and buffers allocated on
    `device` (to_empty), and filled with the rows send() kept; a buffer's further names, the same tensor again."""
    further = aliases(model)
    model.to_empty(device=device)
    buffers = dict(model.named_buffers())
    for module, key, source in further:
        setattr(module, key, buffers[source])  # (nn.Module's: into _buffers for a registered name)
    for name, target in tensors(model):
        if name not in mine:  # (a tied tensor's other names)
            continue
        local = target.to_local() if is_dtensor(target) else target
        rows = mine.pop(name)
        if local.shape != rows.shape:  # FSDP2 cuts otherwise than rows_of (a torch of its own): say so, never train on
            raise RuntimeError(f"strategy.meta_init: fully_shard keeps rows of shape {tuple(local.shape)} of {name} "
                               f"here, and rows_of {tuple(rows.shape)}; set strategy.meta_init=false")
        local.copy_(rows)
    assert not mine, f"tensors fully_shard no longer holds: {sorted(mine)[:3]}"
