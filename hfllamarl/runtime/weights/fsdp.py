"""FSDP2 sharding of the policy over the trainer world (the same code on CPU/gloo and GPU/NCCL).

Accelerate 1.15 does not do FSDP on the CPU (it falls back to one unsharded process per rank,
silently), so the trainer shards the model itself with torch's `fully_shard`: one FSDP unit per
decoder layer, then the root, over the data-parallel ranks of the trainer mesh (`hfllamarl.runtime.world.mesh`);
with trainer tensor parallelism the decoder layers are split inside each tensor-parallel group first
(`tensor_parallel`). Every parameter is then a DTensor; `local_box` says which box of the full tensor a rank holds
(what the weight sync sends and sharded loading reads).
"""

from __future__ import annotations

import torch


class ShardingError(RuntimeError):
    """FSDP2 sharding was requested and cannot run; never a silent fallback."""


def decoder_layer_classes(model: torch.nn.Module) -> set[type]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ShardingError(
            f"Cannot find the decoder layers of {type(model).__name__} to shard (its `_no_split_modules` is "
            f"{sorted(names) or 'empty'}); FSDP2 sharding needs them."
        )
    return classes


def shard_model(model: torch.nn.Module, device_type: str, mixed_precision: str | None = None,
                tp: int | None = None, sequence_parallel: bool = False, shard: int | None = None) -> torch.nn.Module:
    """Shard `model` in place over the trainer world: tensor parallel inside each group of `tp` ranks (default: the
    job's `trainer_tensor_parallel_size`; `tensor_parallel.parallelize`, with `sequence_parallel` the stream between
    the blocks split by sequence too), then FSDP2 over the data-parallel ranks (over groups of `shard` of them,
    replicated across the groups, with `shard` (default: the job's `trainer_fsdp_shard_size`) smaller: hybrid
    sharding)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hfllamarl.runtime.weights.sequence_parallel import SequenceParallelError
    from hfllamarl.runtime.weights.tensor_parallel import TensorParallelError, parallelize
    from hfllamarl.runtime.world.mesh import fsdp_mesh, trainer_mesh

    if not dist.is_initialized():
        raise ShardingError("FSDP2 needs the trainer world (torch.distributed) initialized first.")
    mesh = trainer_mesh(device_type, tp, shard)
    mp = None
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mesh": fsdp_mesh(mesh)} if mp is None else {"mesh": fsdp_mesh(mesh), "mp_policy": mp}
    try:
        layers = [m for cls in decoder_layer_classes(model) for m in model.modules() if isinstance(m, cls)]
        split = "tp" in mesh.mesh_dim_names
        if sequence_parallel and not split:
            raise SequenceParallelError("trainer_sequence_parallel splits the sequence inside a trainer "
                                        "tensor-parallel group: set trainer_tensor_parallel_size > 1 too.")
        if split:
            parallelize(model, layers, mesh["tp"], sequence_parallel)
        for module in layers:
            fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
    except (ShardingError, TensorParallelError, SequenceParallelError):
        raise
    except Exception as exc:
        raise ShardingError(f"FSDP2 sharding of {type(model).__name__} failed: {type(exc).__name__}: {exc}") from exc
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict on CPU (a collective on the trainer world; every rank gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False))


def loaded_on_rank0_only() -> bool:
    """Accelerate's FSDP `cpu_ram_efficient_loading` (on by default): transformers' `from_pretrained` reads
    the weights on the first rank of each node only and leaves the others empty, expecting FSDP to copy them."""
    import os

    return (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
            and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true")


def broadcast_from_rank0(model: torch.nn.Module, device: torch.device) -> None:
    """Give every trainer rank trainer rank 0's parameters and buffers (FSDP1's `sync_module_states`, which
    FSDP2 has not): call before sharding, on every trainer rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device=device)
    else:
        model.to(device)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def held_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
    """(what this rank holds of `t`, the box of the full tensor it is: one [start, end) per dimension): a DTensor's
    local part (FSDP2 rows, or with tensor parallelism a block of rows and columns), or all of a plain tensor."""
    if not hasattr(t, "to_local"):
        t = t.detach()
        return t, tuple((0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, tuple(t.placements))
    return t.to_local(), tuple((int(o), int(o) + int(n)) for o, n in zip(offset, shape))


def _holders(t: torch.Tensor, trainer_rank: int) -> tuple[int, int]:
    """(how many trainer ranks hold the same part of `t`, this rank's index among them)."""
    if not hasattr(t, "to_local"):
        return 1, 0  # a plain tensor: trainer rank 0's to send
    from torch.distributed.tensor import Replicate

    from hfllamarl.runtime.world.mesh import tp_coordinate, trainer_tp

    mesh, count, index = t.device_mesh, 1, 0
    for i, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            count, index = count * mesh.size(i), index * mesh.size(i) + mesh.get_local_rank(i)
    if "tp" not in (mesh.mesh_dim_names or ()) and trainer_tp() > 1:  # tensor parallelism keeps this part whole
        count, index = count * trainer_tp(), index * trainer_tp() + tp_coordinate()
    return count, index


def local_box(t: torch.Tensor, trainer_rank: int) -> tuple[torch.Tensor, tuple[tuple[int, int], ...], bool]:
    """(the part of `t` this rank sends, the box of the full tensor it is, whether it sends anything): what it holds
    (`held_box`), or when several ranks hold the same part (replicated over a mesh dimension, or kept whole by
    tensor parallelism) its share of the rows, so that the holders send a part each. A plain tensor is trainer
    rank 0's."""
    local, box = held_box(t)
    if local.dim() == 0:
        local, box = local.reshape(1), ((0, 1),)
    if not hasattr(t, "to_local"):
        return local, box, trainer_rank == 0
    count, index = _holders(t, trainer_rank)
    if count > 1:
        base, extra = divmod(box[0][1] - box[0][0], count)
        start, rows = index * base + min(index, extra), base + (1 if index < extra else 0)
        local, box = local[start:start + rows], ((box[0][0] + start, box[0][0] + start + rows),) + box[1:]
    return local, box, box[0][1] > box[0][0]


def local_shard(t: torch.Tensor, trainer_rank: int) -> tuple[torch.Tensor, int]:
    """(this rank's rows of `t`, their offset on dim 0): `local_box` of a tensor sharded by rows only (FSDP2 alone);
    a rank that does not send its part gets no rows."""
    local, box, owner = local_box(t, trainer_rank)
    if any(b != (0, n) for b, n in zip(box[1:], tuple(t.shape)[1:])):
        raise ValueError(f"expected a parameter sharded by rows (FSDP2's Shard(0)), got box {box} of {tuple(t.shape)}; "
                         "use local_box for a tensor-parallel layout")
    return (local if owner else local[:0]), box[0][0]
