"""Channels: named, typed links between executors over the bridge process group.

A channel moves picklable objects (tensors included) from its source ranks to its destination
ranks in one of three patterns:

- BROADCAST: one source, every destination receives the same object;
- SCATTER: each source holds a list and splits it into contiguous chunks, one per destination
  (a list of rollout *groups* is scattered, so the completions of one prompt stay together);
- GATHER: every source sends one object to the single destination, which gets them in rank order.

Every operation waits at most the job's `collective_timeout_s`; a peer that died or stopped
answering raises `PeerLostError` naming it. With several generator replicas and
`generator_failure="continue"`, a wait on another replica's rank gives up as soon as that replica is
known to be lost (by this rank's watchdog, or an error on its link) and raises `ReplicaLostError`.
"""

from __future__ import annotations

import enum
import pickle
import threading

import torch

from hfllamarl.runtime.world.liveness import ReplicaLostError
from hfllamarl.runtime.world.topology import PeerLostError, Topology


class ChannelKind(enum.Enum):
    BROADCAST = "broadcast"
    SCATTER = "scatter"
    GATHER = "gather"


def _wait(work, topo: Topology, peer: int, what: str) -> None:
    if topo.contained(peer):
        return _wait_contained(work, topo, peer, what)
    try:
        ok = work.wait(topo.timeout)
    except RuntimeError as exc:
        raise PeerLostError(
            f"{what}: lost {topo.describe(peer)} (seen from {topo.describe(topo.rank)}): {exc}".strip()
        ) from exc
    if ok is False:
        raise PeerLostError(f"{what}: {topo.describe(peer)} did not answer within {topo.timeout_s:.0f} s.")


POLL_S = 0.05  # how often a wait on another replica looks whether that replica was found lost


def _wait_contained(work, topo: Topology, peer: int, what: str) -> None:
    """Wait for `work` with a peer whose loss the job survives: in a helper thread, so that this rank stops
    waiting as soon as the peer's replica is known to be lost (a frozen peer would otherwise hold it for the whole
    timeout; gloo cannot cancel a pending operation, so the helper is left behind with the lost replica's group)."""
    replica = topo.replica_of(peer)
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["ok"] = work.wait(topo.timeout)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        done.set()

    threading.Thread(target=run, name="hfllamarl-wait", daemon=True).start()
    while not done.wait(POLL_S):
        if replica in topo.lost:
            raise ReplicaLostError(replica, f"{what}: {topo.describe_replica(replica)} is lost: {topo.lost[replica]}")
    if "error" in box or box.get("ok") is False:
        cause = (f"{topo.describe(peer)} failed on {what} (seen from {topo.describe(topo.rank)}): "
                 f"{box.get('error') or f'no answer within {topo.timeout_s:.0f} s'}")
        topo.mark_lost(replica, cause)
        raise ReplicaLostError(replica, cause)


def _start(topo: Topology, tensor: torch.Tensor, peer: int, what: str, kind: str, op: str):
    """Post a send or receive (`op`) with bridge rank `peer`; returns a callable that waits for completion. With a
    peer whose loss is survived (`Topology.contained`), a replica already lost (or found lost while posting) gives
    a wait that raises `ReplicaLostError`, so that a caller collecting waits can settle them all."""
    replica = topo.replica_of(peer)
    contained = topo.contained(peer)

    def lost(cause: str):
        topo.mark_lost(replica, cause)

        def wait():
            raise ReplicaLostError(replica, cause)

        return wait

    if contained and replica in topo.lost:
        return lost(topo.lost[replica])
    pg, group_peer = topo.link(peer, kind)
    try:
        work = getattr(pg, op)([tensor], group_peer, 0)
    except RuntimeError as exc:
        cause = f"{what}: lost {topo.describe(peer)} (seen from {topo.describe(topo.rank)}): {exc}".strip()
        if contained:
            return lost(cause)
        raise PeerLostError(cause) from exc

    def wait(_keep_alive=tensor):  # the buffer must outlive the transfer
        _wait(work, topo, peer, what)

    return wait


def send_tensor(topo: Topology, tensor: torch.Tensor, dst: int, what: str, kind: str = "tensor"):
    """Start sending `tensor` to bridge rank `dst`; returns a callable that waits for completion."""
    return _start(topo, tensor, dst, what, kind, "send")


def start_recv_tensor(topo: Topology, tensor: torch.Tensor, src: int, what: str, kind: str = "tensor"):
    """Start receiving into `tensor` from bridge rank `src`; returns a callable that waits for completion."""
    return _start(topo, tensor, src, what, kind, "recv")


def recv_tensor(topo: Topology, tensor: torch.Tensor, src: int, what: str, kind: str = "tensor") -> torch.Tensor:
    """Receive into `tensor` from bridge rank `src` (blocking, bounded by the job timeout)."""
    start_recv_tensor(topo, tensor, src, what, kind)()
    return tensor


def start_send_object(topo: Topology, obj, dst: int, what: str) -> list:
    """Start sending one picklable object to bridge rank `dst`; returns the waits to call."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [send_tensor(topo, size, dst, what, kind="object"), send_tensor(topo, data, dst, what, kind="object")]


def send_objects(topo: Topology, obj, dsts: list[int], what: str) -> None:
    """Send one picklable object to each rank in `dsts`, all at once."""
    for wait in [w for dst in dsts for w in start_send_object(topo, obj, dst, what)]:
        wait()


def recv_object(topo: Topology, src: int, what: str):
    """Receive one picklable object from bridge rank `src`."""
    size = recv_tensor(topo, torch.empty(1, dtype=torch.int64), src, what, kind="object")
    data = recv_tensor(topo, torch.empty(int(size.item()), dtype=torch.uint8), src, what, kind="object")
    return pickle.loads(data.numpy().tobytes())


def split_even(items: list, parts: int) -> list[list]:
    """Split `items` into `parts` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


class Channel:
    """A named link from `src_ranks` to `dst_ranks` (bridge ranks) of one `ChannelKind`."""

    def __init__(self, name: str, kind: ChannelKind, src_ranks: list[int], dst_ranks: list[int], topology: Topology,
                 split=split_even):
        """`split(items, parts)` cuts a SCATTER source's list into one chunk per destination (default: contiguous
        chunks of sizes differing by at most one)."""
        if kind in (ChannelKind.BROADCAST,) and len(src_ranks) != 1:
            raise ValueError(f"channel {name!r}: a BROADCAST has exactly one source, got {src_ranks}")
        if kind is ChannelKind.GATHER and len(dst_ranks) != 1:
            raise ValueError(f"channel {name!r}: a GATHER has exactly one destination, got {dst_ranks}")
        self.name, self.kind = name, kind
        self.src_ranks, self.dst_ranks = list(src_ranks), list(dst_ranks)
        self.topology = topology
        self.split = split

    @property
    def is_source(self) -> bool:
        return self.topology.rank in self.src_ranks

    @property
    def is_destination(self) -> bool:
        return self.topology.rank in self.dst_ranks

    def communicate(self, payload=None):
        """Send `payload` (on source ranks) and return what this rank receives (None if not a destination).

        For SCATTER, `payload` is a list on each source and a destination receives the
        concatenation of its chunks from every source, in source-rank order.
        """
        topo, me, what = self.topology, self.topology.rank, f"channel {self.name!r}"
        kind = self.kind
        if kind is ChannelKind.SCATTER and self.is_source and not isinstance(payload, list):
            raise TypeError(f"{what}: a SCATTER source sends a list, got {type(payload).__name__}")
        # Sends first (they are asynchronous), then receives: no pair of ranks can wait on each other.
        waits = []
        if self.is_source:
            chunks = (
                self.split(payload, len(self.dst_ranks))
                if kind is ChannelKind.SCATTER
                else [payload] * len(self.dst_ranks)
            )
            for dst, chunk in zip(self.dst_ranks, chunks):
                if dst != me:
                    waits += start_send_object(topo, chunk, dst, what)
        received = self._receive(payload) if self.is_destination else None
        for wait in waits:
            wait()
        return received

    def _receive(self, payload):
        topo, me, what, kind = self.topology, self.topology.rank, f"channel {self.name!r}", self.kind
        if kind is ChannelKind.BROADCAST:
            src = self.src_ranks[0]
            return payload if src == me else recv_object(topo, src, what)
        if kind is ChannelKind.GATHER:
            return [payload if src == me else recv_object(topo, src, what) for src in self.src_ranks]
        received = []
        my_index = self.dst_ranks.index(me)
        for src in self.src_ranks:
            if src == me:
                received.extend(self.split(payload, len(self.dst_ranks))[my_index])
            else:
                received.extend(recv_object(topo, src, what))
        return received

    def communicate_with(self, executor) -> None:
        """Controller stage: take the payload from `executor`, communicate, hand back what arrived."""
        payload = executor.get_output(self.name) if self.is_source else None
        received = self.communicate(payload)
        if self.is_destination:
            executor.put_input(self.name, received)


def bridge_barrier(topo: Topology, what: str) -> list[int]:
    """Wait until every rank of the job reaches this point (bounded by the job timeout): a trainer rank passes the
    barrier of each live replica's bridge in turn, a generator rank its own. Returns the replicas lost on the way
    (generator_failure="continue"; they are skipped)."""
    lost = []
    for replica in topo.live_replicas if topo.role == "trainer" else [topo.replica]:
        peer = topo.replica_ranks(replica)[0] if topo.role == "trainer" else 0
        try:
            _wait(topo.bridge("object", replica).barrier(), topo, peer, f"barrier ({what})")
        except ReplicaLostError:
            lost.append(replica)
        except PeerLostError as exc:
            raise PeerLostError(f"barrier ({what}) failed, seen from {topo.describe(topo.rank)}: {exc}") from exc
    return lost
