"""strategy=fsdp's optimizer moments in a checkpoint: every rank writes its own shards (torch.distributed.checkpoint).

An fsdp checkpoint keeps the weights whole in model.safetensors, gathered by rank 0, so a transformers job's
checkpoint stays a save_pretrained dir and either strategy loads it. The optimizer's moments go to
<step>/optimizer/ as DCP shards. Under Adam they are twice the weights' bytes. Every rank writes its own rows in
parallel, and no rank holds more than its own. DCP reads them back on any world size: an fsdp start gets its rows,
a ddp start the full tensors. The shards are written inside the checkpoint's temp dir. Each rank takes the sha256
of its own files, and rank 0 puts them in the COMPLETE marker, so they count only with the rest, renamed together.
Under hybrid sharding (strategy.shard_size) DCP writes each row that several replicas hold once.
Exercised by: tests/test_fsdp.py (resumes on ddp, on 3 fsdp ranks, after preemption and kill -9) and
tests/test_hybrid_sharding.py.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from launcher.train.sharding import is_dtensor

SHARDS = "optimizer"  # the checkpoint's folder of DCP files; train_state.pt names it ("optimizer_moments")
_group: dist.ProcessGroup | None = None
_timeout: timedelta | None = None
_mesh: Any = None


def checkpoint_group(timeout_s: float) -> dist.ProcessGroup:
    """The process group of DCP's collectives, made once; every rank calls this at the same point (a save or a
    resume). It is a group of its own because a background save runs DCP in a thread beside the training's
    collectives. It uses gloo, since DCP exchanges host objects. The timeout is a save's, since ranks wait there
    for the slowest writer."""
    global _group, _timeout
    if _group is None:
        _timeout = timedelta(seconds=timeout_s)
        _group = dist.new_group(backend="gloo", timeout=_timeout)
    return _group


def _is_moment(value: Any) -> bool:
    """A sharded moment: a DTensor of one dim or more (step counts are plain scalars)."""
    return is_dtensor(value) and value.dim() > 0


def moments(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """This rank's shards of the optimizer's moments, by DCP key "state/<i>/<name>"."""
    return {f"state/{index}/{name}": value for index, values in optimizer_state["state"].items()
            for name, value in values.items() if _is_moment(value)}


def without_moments(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """optimizer.state_dict() less what moments() takes: step counts and param groups, for train_state.pt."""
    state = {index: {name: value for name, value in values.items() if not _is_moment(value)}
             for index, values in optimizer_state["state"].items()}
    return {**optimizer_state, "state": state}


def on_host(like: Any, local: torch.Tensor) -> Any:
    """`local`, a host copy of the rows of the DTensor `like`, as a DTensor of the same global shape and placement
    on a CPU mesh laid out as `like`'s: what DCP plans a background write from (its rows' offsets; DCP writes a
    row that several replicas hold once; make_host_mesh() comes first)."""
    from torch.distributed.tensor import DTensor

    assert _mesh is not None, "make_host_mesh() comes first"
    return DTensor.from_local(local, _mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def make_host_mesh(model: torch.nn.Module) -> None:
    """Once, on every rank at the same point (a background save's, before any rank's own work that may fail): a
    CPU mesh of gloo groups with the layout of the model's mesh, for on_host. 1-D: the checkpoint group; hybrid
    sharding's 2-D mesh (replicas x shards): a gloo group for each of its rows and for each of its columns."""
    from torch.distributed.device_mesh import DeviceMesh

    global _mesh
    assert _group is not None, "checkpoint_group() comes first"
    if _mesh is not None:
        return
    mesh = next(p for p in model.parameters() if is_dtensor(p)).device_mesh
    if mesh.ndim == 1:
        _mesh = DeviceMesh.from_group(_group, "cpu")
        return
    layout = mesh.mesh  # the global ranks, (replicas, shards)
    # Every rank makes every row's and column's group, once: use_local_synchronization would spare that, but names a
    # group by its ranks alone, the name split_group gives FSDP's own NCCL group of the same ranks on a GPU
    groups = [dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=_timeout, backend="gloo")[0]
              for ranks in (layout.t(), layout)]  # my replicas' group (a column), my shards' (a row)
    _mesh = DeviceMesh.from_group(groups, "cpu", mesh=layout, mesh_dim_names=mesh.mesh_dim_names)


def write(directory: Path, shards: dict[str, Any], digest: Callable[[Path], str]) -> dict[str, str]:
    """Every rank: its shards into `directory` (rank 0 also DCP's .metadata); on rank 0 the sha256 of every file
    written, by its path from the checkpoint dir ({} elsewhere)."""
    import torch.distributed.checkpoint as dcp

    group = _group
    assert group is not None, "checkpoint_group() comes first"
    # per_thread_copy_ahead=0: DCP's serial loader. Its default, on a CUDA machine, syncs the current CUDA stream,
    # which in a writer thread is GPU 0's, whatever the rank's (a context there for every rank of the node)
    writer = dcp.FileSystemWriter(directory, per_thread_copy_ahead=0)
    metadata = dcp.save(shards, storage_writer=writer, process_group=group)  # (an error here is every rank's)
    rank = dist.get_rank(group)
    try:  # DCP names each rank's files __<rank>_<n>.distcp; the check below fails loudly should that ever change
        mine = [*directory.glob(f"__{rank}_*.distcp"), *([directory / ".metadata"] if rank == 0 else [])]
        sums, failed = {f"{directory.name}/{path.name}": digest(path) for path in mine}, None
    except Exception as error:  # still into the gather below: rank 0 waits there for every rank
        sums, failed = {}, f"rank {rank} could not sum its shards: {type(error).__name__}: {error}"
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object((sums, failed), gathered, dst=0, group=group)
    if failed is not None:
        raise RuntimeError(failed)
    if gathered is None:
        return {}
    first = next((said for _, said in gathered if said is not None), None)
    if first is not None:
        raise RuntimeError(first)
    every = {name: sha for part, _ in gathered for name, sha in part.items()}
    written = {f"{directory.name}/{info.relative_path}" for info in metadata.storage_data.values()}
    if not written <= set(every):
        raise RuntimeError(f"DCP wrote files no rank summed: {sorted(written - set(every))[:3]}")
    return every


def read(directory: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer,
         timeout_s: float) -> dict[str, Any]:
    """train_state.pt's optimizer state with the moments read back from `directory` (every rank): this rank's rows
    of each where its weight is sharded, the full tensor elsewhere (strategy=ddp, any world size)."""
    import torch.distributed.checkpoint as dcp

    group = checkpoint_group(timeout_s)
    reader = dcp.FileSystemReader(directory)
    params = [param for group_ in optimizer.param_groups for param in group_["params"]]
    targets = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        _, index, _ = key.split("/")
        param, dtype = params[int(index)], item.properties.dtype
        targets[key] = (torch.empty_like(param, dtype=dtype) if is_dtensor(param)
                        else torch.empty(item.size, dtype=dtype))
    dcp.load(targets, storage_reader=reader, process_group=group)
    state = {index: dict(values) for index, values in saved["state"].items()}
    for key, tensor in targets.items():
        _, index, name = key.split("/")
        state.setdefault(int(index), {})[name] = tensor
    return {**saved, "state": state}
