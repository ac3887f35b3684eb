"""`nccl_ddma` weight sync: every trainer rank sends its own FSDP2 shard straight to the generators.

LlamaRL's distributed direct memory access (paper, section 4.3): no rank gathers the model. Each
trainer rank holds dim-0 shards of every parameter (FSDP2's `Shard(0)` DTensors) and sends them
to every generator rank itself, all links at once; each generator rank receives the rows from
every trainer rank directly into the rows of the full tensor they belong to, and streams the
full tensors into vLLM's `reload_weights` as they complete.

The plan (which rows of which parameter live on which trainer rank, and how parameters are
grouped into buckets) is computed once at start-up from both sides' shapes and reused every sync.
Parameters at least `bucket_bytes` large travel alone, with no copy on either side (the local
shard is contiguous, and so is a row range of the destination); smaller ones are packed into
buckets of up to `bucket_bytes` so that a layer's norms and biases do not cost a message each.

The transport is the bridge's tensor group: NCCL on GPU, gloo on CPU, one code path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hfllamarl.channels import _wait, recv_object, send_objects, send_tensor
from hfllamarl.weight_sync import WeightSyncBackend


@dataclass(frozen=True)
class ShardInfo:
    """Rows `[row_offset, row_offset + rows)` of parameter `name` live on one trainer rank."""

    name: str
    shape: tuple[int, ...]  # the full parameter's shape
    dtype: torch.dtype
    row_offset: int
    rows: int

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def full_bytes(self) -> int:
        return (self.shape[0] if self.shape else 1) * self.row_numel * self.dtype.itemsize


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
            raise ValueError(f"nccl_ddma: expected FSDP2 Shard(0) placement, got {placements}")
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
        return local, int(offset[0]) if len(offset) else 0
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return (t if trainer_rank == 0 else t[:0]), 0


def plan_buckets(names: list[str], sizes: dict[str, int], dtypes: dict[str, torch.dtype],
                 bucket_bytes: int) -> list[list[str]]:
    """Group consecutive parameters into buckets of <= bucket_bytes of one dtype; a large one travels alone."""
    buckets: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name in names:
        size = sizes[name]
        if size >= bucket_bytes:
            if current:
                buckets.append(current)
                current, current_bytes = [], 0
            buckets.append([name])
            continue
        if current and (current_bytes + size > bucket_bytes or dtypes[current[0]] != dtypes[name]):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


class DDMAWeightSync(WeightSyncBackend):
    """Sharded direct transfer. Options: `bucket_bytes` (default 32 MiB), `max_inflight` buckets (default 4)."""

    def __init__(self, topology, bucket_bytes: int = 32 << 20, max_inflight: int = 4, **options):
        super().__init__(topology, **options)
        self.bucket_bytes = int(bucket_bytes)
        self.max_inflight = max(1, int(max_inflight))

    # ------------------------------------------------------------------ plan (once)
    def setup_trainer(self, model: torch.nn.Module) -> None:
        topo = self.topology
        infos = []
        for name, t in model.state_dict().items():
            local, offset = local_shard(t, topo.rank)
            infos.append(ShardInfo(name, tuple(t.shape) or (1,), t.dtype, offset, local.shape[0] if local.dim() else 1))
        self._set_plan({topo.rank: infos})  # buckets depend on global shapes only: the same on every rank
        send_objects(topo, infos, topo.generator_ranks, "nccl_ddma plan")

    def setup_generator(self) -> None:
        topo = self.topology
        self._set_plan({r: recv_object(topo, r, "nccl_ddma plan") for r in topo.trainer_ranks})

    def _set_plan(self, per_rank: dict[int, list[ShardInfo]]) -> None:
        first = next(iter(per_rank.values()))
        self.names = [i.name for i in first]
        self.info = {i.name: i for i in first}
        self.pieces = {name: [] for name in self.names}  # name -> [(trainer rank, offset, rows)]
        for rank in sorted(per_rank):
            for i in per_rank[rank]:
                if i.rows:
                    self.pieces[i.name].append((rank, i.row_offset, i.rows))
        if len(per_rank) == self.topology.num_trainers:
            for name in self.names:
                rows = sorted((o, n) for _, o, n in self.pieces[name])
                covered = 0
                for o, n in rows:
                    if o != covered:
                        raise ValueError(f"nccl_ddma: the trainer shards of {name} do not tile it (gap at row {covered})")
                    covered += n
                if covered != self.info[name].shape[0]:
                    raise ValueError(f"nccl_ddma: the trainer shards of {name} cover {covered} of "
                                     f"{self.info[name].shape[0]} rows")
        sizes = {n: self.info[n].full_bytes for n in self.names}
        dtypes = {n: self.info[n].dtype for n in self.names}
        self.buckets = plan_buckets(self.names, sizes, dtypes, self.bucket_bytes)

    # ------------------------------------------------------------------ every sync
    def _device(self):
        topo = self.topology
        return torch.device("cpu") if topo.use_cpu else torch.device("cuda", torch.cuda.current_device())

    def send(self, model: torch.nn.Module) -> None:
        topo = self.topology
        state = model.state_dict()
        waits = []
        for bucket in self.buckets:
            locals_ = []
            for name in bucket:
                local, _ = local_shard(state[name], topo.rank)
                if local.numel():
                    locals_.append(local.detach().to(self._device()).contiguous().view(-1))
            if not locals_:
                continue
            payload = locals_[0] if len(locals_) == 1 else torch.cat(locals_)
            for dst in topo.generator_ranks:
                waits.append(send_tensor(topo, payload, dst, f"nccl_ddma bucket {bucket[0]}"))
            # Bound the bytes in flight: wait for the oldest buckets once the window is full.
            while len(waits) > self.max_inflight * len(topo.generator_ranks):
                waits.pop(0)()
        for wait in waits:
            wait()

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        topo = self.topology
        device = self._device()
        pending: list[tuple[list[str], dict[str, torch.Tensor], list]] = []

        def post(bucket: list[str]):
            fulls = {n: torch.empty(self.info[n].shape, dtype=self.info[n].dtype, device=device) for n in bucket}
            works = []  # (wait, unpack) per source rank
            for rank in topo.trainer_ranks:
                parts = [(n, o, r) for n in bucket for (src, o, r) in self.pieces[n] if src == rank]
                if not parts:
                    continue
                if len(parts) == 1:  # a single piece: receive straight into its rows of the full tensor
                    n, o, r = parts[0]
                    works.append((self._irecv(fulls[n].view(fulls[n].shape[0], -1)[o:o + r], rank, n), None))
                else:
                    flat = torch.empty(sum(r * self.info[n].row_numel for n, _, r in parts),
                                       dtype=self.info[parts[0][0]].dtype, device=device)
                    works.append((self._irecv(flat, rank, bucket[0]), (flat, parts)))
            pending.append((bucket, fulls, works))

        queue = list(self.buckets)
        while queue and len(pending) < self.max_inflight:
            post(queue.pop(0))
        while pending:
            bucket, fulls, works = pending.pop(0)
            for wait, unpack in works:
                wait()
                if unpack is not None:
                    flat, parts = unpack
                    pos = 0
                    for n, o, r in parts:
                        k = r * self.info[n].row_numel
                        fulls[n].view(fulls[n].shape[0], -1)[o:o + r].copy_(flat[pos:pos + k].view(r, -1))
                        pos += k
            if queue:
                post(queue.pop(0))
            for n in bucket:
                yield n, fulls[n].view(self.info[n].shape)

    def _irecv(self, buf: torch.Tensor, src: int, what: str):
        """Post a receive into `buf` (contiguous: a row range of a full tensor, or a bucket); return its wait."""
        topo = self.topology
        work = topo.bridge("tensor").recv([buf], src, 0)

        def wait(_keep=buf):
            _wait(work, topo, src, f"nccl_ddma ({what})")

        return wait
