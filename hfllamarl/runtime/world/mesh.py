"""The trainer ranks' device mesh: data parallel (FSDP2) x tensor parallel, the same code on CPU/gloo and GPU/NCCL.

With `trainer_tensor_parallel_size = t`, the T trainer ranks form a `(T / t, t)` mesh named `("dp", "tp")`:
consecutive ranks are one tensor-parallel group (on a GPU node, the ranks that share its fast links), and every
rank of a group trains the same data. So a sum over the data (tokens, rewards, the samples logged) runs over the
`dp` dimension only: `data_group()` is that process group (None with t = 1: the whole trainer world, torch's
default group), and every data reduction on the trainer side passes it.
"""

from __future__ import annotations

_MESHES: dict[tuple, object] = {}
_BUILT = {"tp": 1}  # the tensor-parallel size of the last mesh built (a process without a job: a bench, a test)


def _tp_size() -> int:
    from hfllamarl.runtime.world import topology

    topo = topology._TOPOLOGY
    if topo is None:
        return _BUILT["tp"]
    return topo.trainer_tp if topo.role == "trainer" else 1


def trainer_mesh(device_type: str, tp: int | None = None):
    """The trainer world's mesh: `("dp", "tp")` when `tp` (default: the job's trainer tensor-parallel size) > 1,
    else `("dp",)`. Built once per trainer world (a collective on every trainer rank the first time)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    tp = tp or _tp_size()
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"{world} trainer ranks do not split into tensor-parallel groups of {tp}")
    key = (id(dist.group.WORLD), device_type, world, tp)
    if key not in _MESHES:
        _MESHES.clear()  # (a new trainer world: the old meshes' groups are gone with it)
        shape, names = ((world // tp, tp), ("dp", "tp")) if tp > 1 else ((world,), ("dp",))
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _BUILT["tp"] = tp
    return _MESHES[key]


def data_group():
    """The process group over which trainer ranks hold different data (None: the default group, the whole trainer
    world, when there is no tensor parallelism or no distributed world)."""
    import torch.distributed as dist

    if not dist.is_initialized() or _tp_size() == 1:
        return None
    return trainer_mesh(_device_type())["dp"].get_group()


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
