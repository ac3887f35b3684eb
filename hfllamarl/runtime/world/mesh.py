"""The trainer ranks' device mesh: data parallel (FSDP2) x tensor parallel, the same code on CPU/gloo and GPU/NCCL.

With `trainer_tensor_parallel_size = t`, the T trainer ranks form a `(T / t, t)` mesh named `("dp", "tp")`:
consecutive ranks are one tensor-parallel group (on a GPU node, the ranks that share its fast links), and every
rank of a group trains the same data. So a sum over the data (tokens, rewards, the samples logged) runs over the
`dp` dimension only: `data_group()` is that process group (None with t = 1: the whole trainer world, torch's
default group), and every data reduction on the trainer side passes it.
"""

from __future__ import annotations

_MESHES: dict[tuple, object] = {}
_BUILT = {"tp": 1, "shard": None}  # the last mesh built's sizes (a process without a job: a bench, a test)


def _tp_size() -> int:
    from hfllamarl.runtime.world import topology

    topo = topology._TOPOLOGY
    if topo is None:
        return _BUILT["tp"]
    return topo.trainer_tp if topo.role == "trainer" else 1


def _shard_size() -> int | None:
    from hfllamarl.runtime.world import topology

    topo = topology._TOPOLOGY
    if topo is None:
        return _BUILT["shard"]
    return topo.trainer_shard if topo.role == "trainer" else None


def trainer_mesh(device_type: str, tp: int | None = None, shard: int | None = None):
    """The trainer world's mesh: `("dp", "tp")` when `tp` (default: the job's trainer tensor-parallel size) > 1,
    else `("dp",)`. With `shard` (default: the job's `trainer_fsdp_shard_size`) smaller than the data-parallel
    ranks, `dp` is two dimensions, `("dp_replicate", "dp_shard")` (hybrid sharding: FSDP2 shards over consecutive
    groups of `shard` data-parallel ranks, the groups replicate), flattened as `"dp"` for the data's reductions.
    Built once per trainer world (a collective on every trainer rank the first time)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    tp = tp or _tp_size()
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"{world} trainer ranks do not split into tensor-parallel groups of {tp}")
    dp = world // tp
    shard = shard or _shard_size() or dp
    if dp % shard:
        raise ValueError(f"{dp} data-parallel trainer ranks do not split into FSDP shard groups of {shard}")
    key = (id(dist.group.WORLD), device_type, world, tp, shard)
    if key not in _MESHES:
        _MESHES.clear()  # (a new trainer world: the old meshes' groups are gone with it)
        shape, names = ((dp // shard, shard), ("dp_replicate", "dp_shard")) if shard < dp else ((dp,), ("dp",))
        if tp > 1:
            shape, names = (*shape, tp), (*names, "tp")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if shard < dp:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")  # (then mesh["dp"] is every data-parallel rank)
        _MESHES[key] = mesh
    _BUILT["tp"], _BUILT["shard"] = tp, shard
    return _MESHES[key]


def describe(tp: int, dp: int | None, shard: int | None = None, sequence: bool = False) -> str:
    """A trainer layout in words, as the planner, `hfllamarl train --check` and the benches print it: "tensor
    parallel 2 + sequence x FSDP2 8 x 5 replicas" (`dp`: the data-parallel ranks, None when not known yet)."""
    if shard and (dp is None or shard < dp):
        fsdp = f"FSDP2 {shard} x {dp // shard if dp else '?'} replicas"
    else:
        fsdp = f"FSDP2 {dp or '?'}"
    return f"tensor parallel {tp}{' + sequence' if sequence else ''} x {fsdp}" if tp > 1 else fsdp


def fsdp_mesh(mesh):
    """What FSDP2 shards over: `dp`, or for hybrid sharding the 2-D `("dp_replicate", "dp_shard")` (FSDP2 then
    replicates over the first dimension and shards over the second)."""
    if "dp_shard" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp"]


def data_group():
    """The process group over which trainer ranks hold different data (None: the default group, the whole trainer
    world, when there is no tensor parallelism or no distributed world)."""
    import torch.distributed as dist

    if not dist.is_initialized() or _tp_size() == 1:
        return None
    return trainer_mesh(_device_type())["dp"].get_group()


def tp_group():
    """This trainer rank's tensor-parallel group (None without tensor parallelism or a distributed world): the ranks
    that hold the same data, and so must agree on everything computed from it (rewards, the groups trained)."""
    import torch.distributed as dist

    if not dist.is_initialized() or _tp_size() == 1:
        return None
    return trainer_mesh(_device_type())["tp"].get_group()


def data_world_size() -> int:
    """How many trainer ranks train different data (1 without a distributed world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1
    return dist.get_world_size() // _tp_size()


def trainer_tp() -> int:
    """The job's trainer tensor-parallel size (1 on a generator rank or without a job)."""
    return _tp_size()


def tp_coordinate() -> int:
    """This trainer rank's place in its tensor-parallel group (0 without tensor parallelism)."""
    import torch.distributed as dist

    if not dist.is_initialized() or _tp_size() == 1:
        return 0
    return dist.get_rank() % _tp_size()


def _device_type() -> str:
    from hfllamarl.runtime.world import topology

    topo = topology._TOPOLOGY
    return topo.device_type if topo is not None else "cpu"
