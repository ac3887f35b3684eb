"""`nccl_ddma` weight sync: every trainer rank sends its own FSDP2 shard straight to the generators.

LlamaRL's distributed direct memory access (paper, section 4.3): no rank gathers the model. Each
trainer rank holds a box of every parameter (FSDP2's rows; with trainer tensor parallelism a block of rows and
columns, `local_box`; a part several ranks hold is sent by one of them) and sends it to every generator rank
itself, all links at once; each generator rank receives the boxes from every trainer rank directly into the full
tensor they belong to, and streams the full tensors into vLLM's `reload_weights` as they complete.

With tensor parallelism on the generators, each generator rank receives only the part of each
weight its vLLM shard reads. That part is not restated here per layer type: at start-up each
generator rank asks its own engine (`hfllamarl.runtime.generation.loader_regions`: vLLM's loaders, run on probe
tensors) which box of every weight it reads -- rows of q/k/v (whole KV heads, replicated when a
model has fewer KV heads than the engine has ranks), columns of o/down, a padded vocabulary range,
a range of every expert -- and sends the boxes to the trainer ranks. A weight no generator rank
reads is refused at start-up (vLLM does not know it, so it would never be updated). A tied
`lm_head.weight` travels too: vLLM's CPU backend repacks the lm_head layer only when it is loaded.

The plan (which rows of which parameter live on which trainer rank, which box each generator rank
needs, how parameters are grouped into buckets) is computed once at start-up and reused every
sync. Parameters at least `bucket_bytes` large form a bucket of their own; smaller ones are grouped into buckets
of up to `bucket_bytes`, the unit of the in-flight window. Within a bucket, a piece that is a range of whole rows
and at least `alone_bytes` large travels as a message of its own, with no copy on either side; the others (a
layer's norms and biases, column slices) are packed into one message, so that they do not cost a message each. The received part lands in a full-size tensor that vLLM's
loader narrows to exactly that part (on the CPU vLLM repacks its weights, so they cannot be
written in place).

With R generator replicas every replica needs the whole weight set. The trainer ranks send to the first F
replicas (`fan_out`) and each replica passes every piece on, as it arrives, to the replica F places after it
(its rank i to that replica's rank i: the replicas' engines read the same boxes), so the weights flow down F
chains at once and the time grows with the chains' depth only by one piece per hop, not with R. F defaults to
max(1, trainer ranks // tensor-parallel size): a trainer rank sends its shard, 1/T of the model, to each rank of a
replica in the time that rank takes to receive its 1/m of it, so it can feed T/m replicas without becoming
the bottleneck. With generator_failure="continue" a replica whose relay source is lost mid-sync receives the
rest of the sync as zeros, passes them on likewise (so every transfer still completes), and says so
(`incomplete`): the channel has it, and the replicas downstream of it (`downstream`), sent the version again
before they sample.

The transport is the bridge's tensor group (and a relay group between two replicas): NCCL on GPU, gloo on CPU,
one code path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hfllamarl.contracts import Box, WeightSyncBackend
from hfllamarl.weight_sync import (ReplicaLostError, local_box, recv_object, send_objects, send_tensor, settle,
                                   start_recv_tensor, whole)


@dataclass(frozen=True)
class ShardInfo:
    """The box of parameter `name` one trainer rank sends (None: nothing; another rank holds the same part)."""

    name: str
    shape: tuple[int, ...]  # the full parameter's shape
    dtype: torch.dtype
    box: Box | None

    @property
    def volume(self) -> int:
        return _volume(self.box) if self.box is not None else 0

    @property
    def full_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """The box of weight `name` (full-tensor coordinates) that travels from one trainer rank to one
    generator rank: the generator's box cut to the trainer's."""

    name: str
    box: Box


def plan_piece(shard: ShardInfo, box: Box | None) -> Piece | None:
    """What of `shard` (one trainer rank's box) a generator rank reading `box` receives."""
    if box is None or shard.box is None:
        return None
    cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(shard.box, box))
    if any(start >= end for start, end in cut):
        return None
    return Piece(shard.name, cut)


def _volume(box: Box) -> int:
    n = 1
    for start, end in box:
        n *= end - start
    return n


def _index(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """`box` as slices of a tensor whose first element is at `origin`'s start (None: the full tensor)."""
    starts = [0] * len(box) if origin is None else [s for s, _ in origin]
    return tuple(slice(s - o, e - o) for (s, e), o in zip(box, starts))


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


def relay_layout(replicas: list[int], fan_out: int) -> dict[int, int | None]:
    """For each replica of a sync (in order), the replica it receives the weights from (None: the trainer ranks):
    the first `fan_out` from the trainers, each later one from the replica `fan_out` places before it."""
    return {r: (None if k < fan_out else replicas[k - fan_out]) for k, r in enumerate(replicas)}


class DDMAWeightSync(WeightSyncBackend):
    """Sharded direct transfer. Options: `bucket_bytes` (default 32 MiB), `max_inflight` buckets (default 4),
    `fan_out` (replicas the trainer ranks send to directly; default max(1, trainer ranks // tensor-parallel size)),
    `alone_bytes` (a row-range piece this large travels as a message of its own, copied nowhere; default 1 MiB)."""

    def __init__(self, topology, bucket_bytes: int = 32 << 20, max_inflight: int = 4, fan_out: int | None = None,
                 alone_bytes: int = 1 << 20, **options):
        super().__init__(topology, **options)
        self.bucket_bytes = int(bucket_bytes)
        self.alone_bytes = int(alone_bytes)
        self.max_inflight = max(1, int(max_inflight))
        self.fan_out = int(fan_out) if fan_out else max(1, topology.num_trainers // topology.replica_size)
        self.incomplete = False  # the last receive() lost its relay source part-way (see the module docstring)
        self.sent_bytes = 0  # what this trainer rank sent in the last sync (every link counted)

    def layout(self) -> dict[int, int | None]:
        """replica -> where it receives the next sync from (None: the trainer ranks), over `targets`."""
        topo = self.topology
        return relay_layout(list(self.targets if self.targets is not None else range(topo.num_replicas)),
                            self.fan_out)

    def downstream(self, replica: int) -> list[int]:
        """The replicas the last sync reached through `replica` (they hold what it passed on)."""
        layout, out, frontier = self.layout(), [], {replica}
        while frontier:
            frontier = {r for r, src in layout.items() if src in frontier}
            out += sorted(frontier)
        return out

    # ------------------------------------------------------------------ plan (once)
    def setup_trainer(self, model: torch.nn.Module) -> None:
        topo = self.topology
        infos = []
        for name, t in model.state_dict().items():
            _, box, owner = local_box(t, topo.rank)
            infos.append(ShardInfo(name, tuple(t.shape) or (1,), self.wire_dtype(t.dtype), box if owner else None))
        send_objects(topo, infos, topo.generator_ranks, "nccl_ddma plan")
        self.boxes = {g: recv_object(topo, g, "nccl_ddma boxes") for g in topo.generator_ranks}
        for g in topo.generator_ranks:  # every replica's engine must read what replica 0's does (relays rely on it)
            first = topo.replica_ranks(0)[topo.local_rank_of(g)]
            if self.boxes[g] != self.boxes[first]:
                raise ValueError(f"nccl_ddma: {topo.describe(g)} reads other parts of the weights than "
                                 f"{topo.describe(first)}; every replica must run the same engine layout.")
        self._set_plan({topo.rank: infos})
        unread = [n for n in self.names if all(self.boxes[g].get(n) is None for g in topo.generator_ranks)]
        if unread:
            raise ValueError(
                f"nccl_ddma: the generator's vLLM loader reads none of {unread[:5]}{' ...' if len(unread) > 5 else ''}: "
                "this model's layout is not one vLLM loads under these names, so those weights would never reach "
                "the generator. Save the model with save_pretrained() from a transformers version vLLM supports, "
                "or use a model family vLLM runs.")

    def setup_generator(self, loader_boxes=None) -> None:
        """`loader_boxes(weights)` -> {name: box or None}: what this rank's engine reads of each weight
        (`hfllamarl.runtime.generation.loader_regions.read_regions`); None: whole tensors (an engine that narrows itself)."""
        topo = self.topology
        per_rank = {r: recv_object(topo, r, "nccl_ddma plan") for r in topo.trainer_ranks}
        first = next(iter(per_rank.values()))
        weights = [(i.name, i.shape) for i in first]
        mine = loader_boxes(weights) if loader_boxes is not None else {n: whole(s) for n, s in weights}
        send_objects(topo, mine, topo.trainer_ranks, "nccl_ddma boxes")
        self.boxes = {topo.rank: mine}
        self._set_plan(per_rank)
        self._check_tiling()
        layout, me = relay_layout(list(range(topo.num_replicas)), self.fan_out), topo.replica
        for up, down in [(layout[me], me)] + [(me, r) for r, src in layout.items() if src == me]:
            if up is not None:  # the relay groups of the first layout, built now (a rendezvous of both replicas)
                topo.relay(up, down)

    def region(self, name: str, generator_rank: int) -> Box | None:
        """The box of weight `name` generator rank `generator_rank` receives."""
        return self.boxes[generator_rank].get(name)

    def receives(self, name: str, generator_rank: int) -> bool:
        return self.boxes[generator_rank].get(name) is not None

    def _set_plan(self, per_rank: dict[int, list[ShardInfo]]) -> None:
        topo = self.topology
        first = next(iter(per_rank.values()))
        self.names = [i.name for i in first]
        self.info = {i.name: i for i in first}
        self.shards = per_rank
        # pieces[(trainer, generator)][name] -> Piece: what travels on each link (each rank plans only its own)
        self.pieces: dict[tuple[int, int], dict[str, Piece]] = {}
        for t, infos in per_rank.items():
            for g, boxes in self.boxes.items():
                link = {}
                for i in infos:
                    piece = plan_piece(i, boxes.get(i.name))
                    if piece is not None:
                        link[i.name] = piece
                self.pieces[(t, g)] = link
        sizes = {n: self.info[n].full_bytes for n in self.names}
        dtypes = {n: self.info[n].dtype for n in self.names}
        self.buckets = plan_buckets(self.names, sizes, dtypes, self.bucket_bytes)
        me = topo.rank
        # A generator rank yields only the weights its engine reads.
        self.wanted = {n for (t, g), link in self.pieces.items() if g == me for n in link}

    def _check_tiling(self) -> None:
        """The trainer ranks' boxes of every weight are distinct, inside it, and as large as it together."""
        for name in self.names:
            shape = self.info[name].shape
            boxes = [i.box for infos in self.shards.values() for i in infos if i.name == name and i.box is not None]
            inside = all(0 <= s < e <= n for box in boxes for (s, e), n in zip(box, shape))
            covered = sum(_volume(b) for b in boxes)
            if not inside or len(set(boxes)) != len(boxes) or covered != _volume(whole(shape)):
                raise ValueError(f"nccl_ddma: the trainer shards of {name} {tuple(shape)} do not tile it: {boxes}")

    # ------------------------------------------------------------------ every sync
    def send(self, model: torch.nn.Module) -> None:
        topo = self.topology
        state = model.state_dict()
        locals_ = {}
        for name in self.names:
            local, box, _ = local_box(state[name], topo.rank)
            locals_[name] = (local.detach().to(self.device, self.info[name].dtype), box)
        self.sent_bytes = 0
        entries = [r for r, src in self.layout().items() if src is None]
        ranks = [g for r in entries for g in topo.replica_ranks(r)]
        waits = []
        for bucket in self.buckets:
            payloads: dict[tuple, torch.Tensor] = {}  # the same pieces (another replica's rank) are packed once
            for g in ranks:
                if topo.replica_of(g) in topo.lost:
                    continue
                for message in self.messages(self.pieces[(topo.rank, g)], bucket):
                    key = tuple((p.name, p.box) for p in message)
                    if key not in payloads:
                        parts = []
                        for p in message:
                            local, box = locals_[p.name]
                            parts.append(local.reshape([e - s for s, e in box])[_index(p.box, box)])
                        payloads[key] = (parts[0].contiguous() if len(parts) == 1
                                         else torch.cat([x.reshape(-1) for x in parts]))
                    waits.append(send_tensor(topo, payloads[key], g, f"nccl_ddma bucket {bucket[0]}"))
                    self.sent_bytes += payloads[key].numel() * payloads[key].element_size()
            # Bound the bytes in flight: wait for the oldest buckets once the window is full.
            while len(waits) > self.max_inflight * max(len(ranks), 1) * 4:
                settle([waits.pop(0)])
        settle(waits)

    def messages(self, link: dict[str, Piece], bucket: list[str]) -> list[list[Piece]]:
        """How one bucket's pieces travel on one link: a piece of at least `alone_bytes` that is a range of whole rows
        of its weight is a message of its own (it leaves the sender's shard and lands in the receiver's full tensor
        with no copy); the others follow, packed into one message."""
        alone, packed = [], []
        for name in bucket:
            if name not in link:
                continue
            piece, info = link[name], self.info[name]
            rows = all(b == (0, size) for b, size in zip(piece.box[1:], info.shape[1:]))
            (alone if rows and _volume(piece.box) * info.dtype.itemsize >= self.alone_bytes else packed).append(piece)
        return [[p] for p in alone] + ([packed] if packed else [])

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        topo, me = self.topology, self.topology.rank
        device = self.device
        layout = self.layout()
        up = layout[topo.replica]  # None: the trainer ranks send to this replica themselves
        source = (lambda t: t) if up is None else (lambda t: topo.replica_ranks(up)[topo.local_rank])
        down = [topo.replica_ranks(r)[topo.local_rank] for r, src in layout.items() if src == topo.replica]
        pending: list[tuple[list[str], dict[str, torch.Tensor], list]] = []
        forwards: list = []
        self.incomplete = False

        def dest(full: torch.Tensor, p: Piece) -> torch.Tensor:
            return full.view(self.info[p.name].shape)[_index(p.box)]

        def post(bucket: list[str]):
            fulls = {n: torch.empty(self.info[n].shape, dtype=self.info[n].dtype, device=device)
                     for n in bucket if n in self.wanted}
            works = []  # (wait or None: zeros, the buffer received into, parts to unpack or None)
            for t in topo.trainer_ranks:
                for parts in self.messages(self.pieces[(t, me)], bucket):
                    if len(parts) == 1 and dest(fulls[parts[0].name], parts[0]).is_contiguous():
                        # A piece that is a row range: it lands straight in the full tensor.
                        buf, unpack = dest(fulls[parts[0].name], parts[0]), None
                    else:
                        total = sum(dest(fulls[p.name], p).numel() for p in parts)
                        buf = torch.empty(total, dtype=self.info[parts[0].name].dtype, device=device)
                        unpack = parts
                    wait = None if self.incomplete else self._irecv(buf, source(t), parts[0].name)
                    works.append((wait, buf, unpack))
            pending.append((bucket, fulls, works))

        queue = list(self.buckets)
        while queue and len(pending) < self.max_inflight:
            post(queue.pop(0))
        while pending:
            bucket, fulls, works = pending.pop(0)
            for wait, buf, unpack in works:
                self._arrive(wait, buf)
                for g in down:  # pass it on to the replica after this one, as it is (the same boxes)
                    forwards.append(send_tensor(topo, buf, g, f"nccl_ddma relay ({bucket[0]})"))
                if unpack is not None:
                    pos = 0
                    for p in unpack:
                        d = dest(fulls[p.name], p)
                        d.copy_(buf[pos:pos + d.numel()].view(d.shape))
                        pos += d.numel()
            while len(forwards) > self.max_inflight * len(self.topology.trainer_ranks) * max(len(down), 1) * 4:
                settle([forwards.pop(0)])
            if queue:
                post(queue.pop(0))
            for n in bucket:
                if n in fulls:
                    yield n, fulls[n]
        settle(forwards)  # a lost downstream replica is left out

    def _arrive(self, wait, buf: torch.Tensor) -> None:
        """Wait for one piece; once the relay source is lost (`incomplete`), the rest of the sync is zeros."""
        if wait is not None and not self.incomplete:
            try:
                wait()
                return
            except ReplicaLostError:
                self.incomplete = True
        buf.zero_()

    def _irecv(self, buf: torch.Tensor, src: int, what: str):
        """Post a receive into `buf` (contiguous: a row range of a full tensor, or a bucket); return its wait."""
        return start_recv_tensor(self.topology, buf, src, f"nccl_ddma ({what})")
