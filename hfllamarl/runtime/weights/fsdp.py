"""FSDP2 sharding of the policy over the trainer world (the same code on CPU/gloo and GPU/NCCL).

Accelerate 1.15 does not do FSDP on the CPU (it falls back to one unsharded process per rank,
silently), so the trainer shards the model itself with torch's `fully_shard`: one FSDP unit per
decoder layer, then the root. The weight sync relies on this layout: every parameter is a
DTensor sharded on dim 0 across the trainer ranks.
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


def shard_model(model: torch.nn.Module, device_type: str, mixed_precision: str | None = None) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 over the default process group (the trainer world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise ShardingError("FSDP2 needs the trainer world (torch.distributed) initialized first.")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp = None
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    try:
        for cls in decoder_layer_classes(model):
            for module in [m for m in model.modules() if isinstance(m, cls)]:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
    except ShardingError:
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


def local_shard(t: torch.Tensor, trainer_rank: int) -> tuple[torch.Tensor, int]:
    """(this rank's rows of `t`, their offset on dim 0). A plain tensor belongs to trainer rank 0."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        placements = tuple(t.placements)
        local = t.to_local()
        if all(isinstance(p, Replicate) for p in placements):
            return (local if trainer_rank == 0 else local[:0]), 0
        if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
            raise ValueError(f"expected an FSDP2 Shard(0) placement, got {placements}")
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
        return local, int(offset[0]) if len(offset) else 0
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return (t if trainer_rank == 0 else t[:0]), 0
