"""strategy=fsdp: FSDP2's fully_shard on each block of the model, then the root, and the full weights its
checkpoints hold.

Every rank keeps 1/world of each weight, gradient and optimizer moment (Shard(0) DTensors; between the
micro-batches of an accumulating step its own whole gradients, which the last one's backward reduce-scatters,
unless strategy.reduce_every_micro_batch reduce-scatters each backward's: launcher/train/step.py) and all-gathers a
block's weights while the block runs; with strategy.shard_size (hybrid sharding) 1/shard_size, each group of
ranks a replica. By default (strategy.meta_init) only rank 0 builds the model whole; the others build it on the
meta device and receive their rows (launcher/train/meta_init.py). A checkpoint holds the full weights in DDP's
model.safetensors: rank 0 gathers them (one all-gather per tensor, to host memory), and a start reads them and
keeps its own rows. So a transformers job's checkpoint stays a save_pretrained dir. The optimizer's moments are
written by every rank in shards (launcher/train/sharded_checkpoint.py). A checkpoint resumes on any world size and
on either strategy; a DDP checkpoint's full moments load on fsdp by shard_optimizer_state. Exercised by:
tests/test_fsdp.py, tests/test_fsdp_accumulation.py, tests/test_hybrid_sharding.py (`python -m launcher +exp=toy
strategy=fsdp`).
"""
from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from launcher.derived import ConfigError
from launcher.train.dist import follow_main_timeout
from launcher.train.precision import Precision

# what the dry run and the launcher's first line say: the workers find the blocks (the parent builds no model)
# (the workers' line then says what they sharded, and each BatchNorm gathered in its own dtype)
RULE = ("each block (transformers' _no_split_modules, else the layers of the model's stack, else each Linear), "
        "then the root")


def blocks(model: nn.Module, block: str | None) -> tuple[list[nn.Module], str]:
    """The model's blocks (outermost first: none inside another), and what found them (RULE): fsdp shards them one
    by one, and train.compile_scope=block compiles them."""
    named = next((m._no_split_modules for m in model.modules() if getattr(m, "_no_split_modules", None)), None)
    stack = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
                  and len({type(layer) for layer in m}) == 1), None)  # a transformer's layers: all one class
    if block:
        names, why = {block}, f"strategy.block={block}"
    elif named:
        names, why = set(named), "the model's _no_split_modules"
    elif stack is not None:
        names, why = {type(stack[0]).__name__}, "the layers of the model's stack"
    else:
        names, why = {"Linear"}, "each Linear"
    # a weight tied to one outside the block (BERT's word embeddings and its MLM decoder) stays with the root:
    # FSDP2 shards each parameter in one group only
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model or type(module).__name__ not in names:
            continue
        own: dict[int, int] = {}
        for _, param in module.named_parameters(remove_duplicate=False):
            own[id(param)] = own.get(id(param), 0) + 1
        if all(uses[key] == count for key, count in own.items()):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if not found:
        raise ConfigError(f"the model has no module of class {' or '.join(sorted(names))} ({why}); "
                         f"name its block class with strategy.block=<class name>")
    kinds = sorted({type(m).__name__ for m in found})
    return found, f"{len(found)} x {'/'.join(kinds)} ({why})"


def shard_size(value: int | str | None, world_size: int, nproc_per_node: int) -> int:
    """strategy.shard_size as a number of ranks: null, the world; `node`, a node's ranks; else a number that
    divides the world (the parent checks it for every world size the run may have, the worker for the one it has)."""
    size = world_size if value is None else nproc_per_node if value == "node" else value
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world_size % size:
        raise ConfigError(f"strategy.shard_size={value!r} must be null (all {world_size} ranks), node, or a number "
                          f"of ranks that divides the world size {world_size}")
    if nproc_per_node % size and size % nproc_per_node:  # its groups would straddle nodes: gathers cross them
        raise ConfigError(f"strategy.shard_size={size} splits nodes of {nproc_per_node} workers across groups; use a "
                          f"divisor or a multiple of {nproc_per_node} (node: {nproc_per_node})")
    return size


def shard(model: nn.Module, reshard_after_forward: bool, block: str | None, precision: Precision,
          device: torch.device, world_size: int, group_size: int,
          compile_blocks: Callable[[list[nn.Module]], None] | None = None) -> str:
    """fully_shard the model in place (each block, then the root); what was sharded, in words.

    `compile_blocks` (train.compile): the blocks' forwards are compiled in place first, torchtitan's way
    (launcher/train/compiled.py): FSDP2's gathers and reduce-scatters run eagerly between the compiled blocks.

    `group_size` < `world_size` (strategy.shard_size) is hybrid sharding: consecutive ranks shard each weight among
    themselves, and every such group keeps a replica (FSDP2's 2-D mesh: replicas x shards). The gathers then stay
    within a group (a node's fast links), and each reduction is a reduce-scatter in the group, then an all-reduce of
    the shard across the groups.

    Under bf16/fp16 the gathered weights are cast to that dtype once per gather (FSDP2's mixed precision: half
    the all-gather's bytes) and gradients are reduced in float32; the shards, and so the optimizer, stay in the
    weights' own dtype. The forward still runs under autocast, as with DDP: ops that need float32 (softmax,
    layer norm, the loss) get it. A BatchNorm's weights are gathered in their own dtype, in a group of their own:
    FSDP2 casts a group's parameters but never its buffers, and batch_norm takes its weights and running
    statistics in one dtype (under bf16 it failed, `expected scalar type BFloat16 but found Float`), as DDP's
    autocast leaves them.

    The root keeps its weights from the forward to the backward, torch's own choice for it (on torch 2.13 only
    where reshard_after_forward is left unset; earlier ones choose so whatever it is): resharding them there
    would gather them again at once."""
    # imported here: FSDP2 and DTensor cost each process 1.2 s to import, and more at its exit, which a DDP run
    # does not pay (the launcher's parent imports this module too; bench/launch_time.py)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = precision.autocast_dtype
    reduce_dtype = torch.float32 if dtype else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    replicas = world_size // group_size
    mesh = (init_device_mesh(device.type, (world_size,)) if replicas == 1 else
            init_device_mesh(device.type, (replicas, group_size), mesh_dim_names=("replicate", "shard")))
    if replicas > 1:  # (a 1-D mesh over the world is the main group itself)
        follow_main_timeout(*(mesh.get_group(dim) for dim in range(mesh.ndim)))
    found, said = blocks(model, block)
    if compile_blocks:
        compile_blocks(found)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m is not model
             and next(m.parameters(recurse=False), None) is not None] if dtype else []  # frozen too
    for module in norms:  # before the blocks that hold them: fully_shard leaves a group's inner groups' weights out
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    for module in found:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    root_chooses = inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    fully_shard(model, mesh=mesh, reshard_after_forward=None if root_chooses and reshard_after_forward
                else reshard_after_forward, mp_policy=policy)
    hybrid = f"; over {group_size} rank{'s' * (group_size > 1)}, {replicas} replicas (hybrid)" if replicas > 1 else ""
    return f"{said}, then the root{hybrid}" + (f"; {len(norms)} x BatchNorm gathered in its own dtype" if norms else "")


def is_sharded(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # shard() imports it: until then no module is sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_dtensor(value: Any) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")  # (fully_shard imports it: until then none is one)
    return tensor is not None and isinstance(value, tensor.DTensor)


@contextmanager
def no_gradient_sync(model: nn.Module, reduce_scatter: bool = False) -> Iterator[None]:
    """The backwards inside accumulate this rank's gradients only: DDP's no_sync, or FSDP2's reduce-scatter off
    (the gradients stay unsharded until the last micro-batch's backward reduces them). With `reduce_scatter`
    (strategy.reduce_every_micro_batch) each backward still reduce-scatters into the shards; only hybrid sharding's
    all-reduce across the replicas waits for the last micro-batch (pytorch#126166)."""
    if not is_sharded(model):
        with model.no_sync():
            yield
        return
    turn = model.set_requires_all_reduce if reduce_scatter else model.set_requires_gradient_sync
    turn(False)
    try:
        yield
    finally:
        turn(True)


def total_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The global 2-norm of the gradients: sharded ones' norm is all-reduced over the shards (DTensor), the
    same on every rank; a plain tensor on `device` either way (torch gives a CPU zero for no gradients)."""
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if is_dtensor(norm) else norm


def _full(value: Any, on_rank_0: bool) -> Any:
    """A tensor's full value on rank 0's host (every rank enters the all-gather of a DTensor); None elsewhere."""
    if not isinstance(value, torch.Tensor):
        return value
    full = value.full_tensor() if is_dtensor(value) else value.detach()
    # a copy of its own: on CPU ranks full_tensor() of uneven shards is a view of a padded buffer, which
    # safetensors refuses to write (a synchronous save writes these tensors as they are)
    return full.to("cpu", copy=True) if on_rank_0 else None


@torch.no_grad()  # (full_tensor() of a parameter would record the all-gather for autograd)
def full_weights(model: nn.Module, on_rank_0: bool) -> dict[str, torch.Tensor]:
    """The model's state_dict with full tensors, tied weights one tensor as in the module (rank 0; {} elsewhere).
    One all-gather per tensor: no rank ever holds more than one full tensor at a time on its device."""
    gathered: dict[int, Any] = {}
    full = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in gathered:
            gathered[id(tensor)] = _full(tensor, on_rank_0)
        full[name] = gathered[id(tensor)]
    return full if on_rank_0 else {}


def _rows(like: Any) -> tuple[slice, ...]:
    """The index of this rank's part of a full tensor as fully_shard keeps it (`like`: its DTensor): torch.chunk's
    piece along the sharded dim (Shard(0) on a 1-D mesh; on hybrid sharding's 2-D mesh Shard(0) within a group,
    the groups replicas); empty for a rank past the last piece."""
    from torch.distributed.tensor import Replicate, Shard

    (mesh_dim, placement), = [(i, p) for i, p in enumerate(like.placements) if isinstance(p, Shard)]
    assert all(isinstance(p, Replicate) for i, p in enumerate(like.placements) if i != mesh_dim), like.placements
    mesh = like.device_mesh
    piece = rows_of(like.shape[placement.dim], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    return (slice(None),) * placement.dim + (piece,)


def rows_of(length: int, parts: int, index: int) -> slice:
    """Piece `index` of `parts` of `length` rows as torch.chunk cuts them (FSDP2's Shard(0)): the last shorter,
    or none at all."""
    size = -(-length // parts)
    start = min(index * size, length)
    return slice(start, min(start + size, length))


def _my_rows(full: Any, like: Any, shape: list[int]) -> torch.Tensor:
    """This rank's part of `full` (a tensor, or safetensors' slice of one in a file, read alone), of `shape`, on
    the shard's device, in its dtype, a copy of its own (not a view that keeps `full`)."""
    local = like.to_local()
    if list(shape) != list(like.shape):
        raise ValueError(f"a checkpoint tensor of shape {tuple(shape)} does not fit a parameter of shape "
                         f"{tuple(like.shape)}")
    return full[_rows(like)].to(device=local.device, dtype=local.dtype, copy=True)


@torch.no_grad()
def load_full_weights(model: nn.Module, path: Path) -> None:
    """Copy the full tensors of a checkpoint's model.safetensors into the shards, each rank reading only its rows
    from the file (1/world of the reads from a shared file system at every resume, where each rank read it whole);
    the names and shapes fit: checkpoint.load_latest checked them. A name the file leaves out is tied to one it
    holds (safetensors saves tied weights once)."""
    from safetensors import safe_open

    targets = model.state_dict(keep_vars=True)
    with safe_open(str(path), framework="pt") as tensors:
        for name in tensors.keys():
            target = targets[name]
            if is_dtensor(target):
                rows = tensors.get_slice(name)
                target.to_local().copy_(_my_rows(rows, target, rows.get_shape()))
            else:
                target.copy_(tensors.get_tensor(name))


def shard_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's full optimizer state (DDP's layout) as this rank's shards, for optimizer.load_state_dict:
    each moment the shape of its parameter becomes a DTensor like the parameter; step counts stay."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, moments in saved["state"].items():
        param = params[int(index)]
        state[index] = {key: DTensor.from_local(_my_rows(value, param, list(value.shape)), param.device_mesh,
                                                param.placements, shape=param.shape, stride=param.stride())
                        if is_dtensor(param) and isinstance(value, torch.Tensor)
                        and value.shape == param.shape else value
                        for key, value in moments.items()}
    return {**saved, "state": state}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank keeps: its weights, the gradients the optimizer steps with (one per trainable weight, its
    size) and the optimizer's state, in bytes (a DTensor counts its local shard)."""
    def size(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        return local.numel() * local.element_size()
    params = list(model.parameters())
    return {"params": sum(size(p) for p in params), "grads": sum(size(p) for p in params if p.requires_grad),
            "optimizer": sum(size(v) for moments in optimizer.state.values() for v in moments.values()
                             if isinstance(v, torch.Tensor))}
