"""The policy-weights channel, and helpers of weight-sync backends (their contract: `hfllamarl.contracts`).

A backend (entry point group `hfllamarl.weight_sync`) moves the trainer's policy weights to the
generator ranks. The channel decides *when* and *where*: a one-object header from trainer rank 0 to every
rank of every live replica says which policy version follows (or that none does) and which replicas are
live this tick; the backend decides *how*.
"""

from __future__ import annotations

import time

import torch

from hfllamarl.contracts import Box, WeightSyncBackend
from hfllamarl.registry import load_plugin

from hfllamarl.runtime.loop.channels import recv_object, start_send_object
from hfllamarl.runtime.world.liveness import ReplicaLostError
from hfllamarl.runtime.world.topology import Topology

POLICY_WEIGHTS = "policy_weights"
REPLICAS = "replicas"  # what the generator executor is told each tick: the live replicas (`put_input`)
DATA_OFFSET = "data_offset"  # trainer replica groups: the global batch of the job's batch 0 (`put_input`)
HEAD_START = "head_start"  # the trainer's first tokens of the generator's next batch (`runtime.training.head_start`)


def settle(waits) -> set[int]:
    """Call every wait of `waits`; a replica found lost (generator_failure="continue") is left out and the
    others are finished. Returns the replicas lost on the way."""
    lost = set()
    for wait in waits:
        try:
            wait()
        except ReplicaLostError as exc:
            lost.add(exc.replica)
    return lost

def verify_dir(output_dir: str, version: int) -> str:
    """Where the trainer writes policy `version` for `verify_weight_sync` (a directory both sides see)."""
    import os

    return os.path.join(output_dir, ".hfllamarl", "verify", f"version-{version}")


def tensor_digest(named_tensors) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in name order: equal digests mean
    bitwise-equal weight sets, whatever order they arrived in."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda item: item[0]):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def whole(shape) -> Box:
    """The box covering a whole tensor of `shape`."""
    return tuple((0, int(s)) for s in shape)


def crop(tensor: torch.Tensor, box: Box | None) -> torch.Tensor:
    """The part of `tensor` a box (see `WeightSyncBackend.region`) names; None: all of it."""
    if box is None:
        return tensor
    return tensor[tuple(slice(s, e) for s, e in box)]


def build_backend(name: str, topology: Topology, **options) -> WeightSyncBackend:
    cls = load_plugin("weight_sync", name)
    return cls(topology, **options)


class WeightsChannel:
    """The `policy_weights` channel: trainer -> generator replicas, through a weight-sync backend.

    The trainer executor's `get_output("policy_weights")` returns `(model, version)` when it has
    weights the generator has not seen, else None; the generator executor's
    `put_input("policy_weights", (version, weights_iterator))` loads them. With a `dispatch`
    (`hfllamarl.runtime.loop.dispatch.Dispatch`), the trainer ranks first agree on the live replicas and the
    generator executor is told them (`put_input("replicas", live)`). When the trainer executors'
    `stop_requested()` (agreed over the trainer ranks) says the run ends here, no weights are sent: the header
    says stop, and every rank's executor is marked `stopped` (the controller leaves the loop).
    """

    name = POLICY_WEIGHTS

    def __init__(self, backend: WeightSyncBackend, topology: Topology, dispatch=None):
        self.backend, self.topology, self.dispatch = backend, topology, dispatch
        self.last_seconds = 0.0  # the transfer itself
        self.last_wait_seconds = 0.0  # waiting for the other side to reach the channel

    def communicate_with(self, executor) -> None:
        start = time.perf_counter()
        topo = self.topology
        if topo.role == "trainer":
            stop = executor.stop_requested()  # (the trainer ranks agree on it)
            out = None if stop else executor.get_output(POLICY_WEIGHTS)
            live = self.dispatch.begin_tick(executor) if self.dispatch is not None else topo.live_replicas
            # (the trainer's head start on the batch the generator samples next, while the generator finishes its
            # tick: `runtime.training.head_start`)
            head = None if stop or getattr(executor, "head_start", None) is None else executor.head_start.sample(executor)
            if topo.rank == 0:
                header = {"version": None if out is None else out[1], "live": live, "stop": stop}
                if head is not None:
                    header[HEAD_START] = head
                if getattr(executor, DATA_OFFSET, 0):  # (trainer replica groups, once a group healed: never 0 again)
                    header[DATA_OFFSET] = executor.data_offset
                settle([w for r in live for g in topo.replica_ranks(r)
                        for w in start_send_object(topo, header, g, f"channel '{POLICY_WEIGHTS}/header'")])
            executor.stopped = stop
            ready = time.perf_counter()
            if out is not None:
                self.backend.targets = [r for r in live if r not in topo.lost]
                self.backend.send(out[0])
        else:
            header = recv_object(topo, 0, f"channel '{POLICY_WEIGHTS}/header'")
            if header.get("stop"):
                executor.stopped = True
                return
            if self.dispatch is not None:
                executor.put_input(REPLICAS, header["live"])
            if DATA_OFFSET in header:
                executor.put_input(DATA_OFFSET, header[DATA_OFFSET])
            if HEAD_START in header:
                executor.put_input(HEAD_START, header[HEAD_START])
            ready = time.perf_counter()
            if header["version"] is not None:
                self.backend.targets = header["live"]
                self.receive(executor, header["version"])
        self.last_wait_seconds = ready - start
        self.last_seconds = time.perf_counter() - ready

    def receive(self, executor, version: int) -> None:
        """Generator side: load `version` through the backend. A replica this one relays weights from may be lost
        mid-way (generator_failure="continue"): the engine then holds a partial load, said in
        `executor.weights_broken`, and the trainer ranks send the whole version again before it samples."""
        try:
            executor.put_input(POLICY_WEIGHTS, (version, self.backend.receive()))
            executor.weights_broken = bool(getattr(self.backend, "incomplete", False))
        except ReplicaLostError:
            executor.weights_broken = True
