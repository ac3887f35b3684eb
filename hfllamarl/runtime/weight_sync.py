"""The policy-weights channel, and helpers of weight-sync backends (their contract: `hfllamarl.contracts`).

A backend (entry point group `hfllamarl.weight_sync`) moves the trainer's policy weights to the
generator ranks. The channel decides *when* (a one-object header from trainer rank 0 says which
policy version follows, or that none does), the backend decides *how*.
"""

from __future__ import annotations

import time

import torch

from hfllamarl.contracts import Box, WeightSyncBackend
from hfllamarl.registry import load_plugin

from .channels import Channel, ChannelKind
from .topology import Topology

POLICY_WEIGHTS = "policy_weights"

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
    """The `policy_weights` channel: trainer -> generator, through a weight-sync backend.

    The trainer executor's `get_output("policy_weights")` returns `(model, version)` when it has
    weights the generator has not seen, else None; the generator executor's
    `put_input("policy_weights", (version, weights_iterator))` loads them.
    """

    name = POLICY_WEIGHTS

    def __init__(self, backend: WeightSyncBackend, topology: Topology):
        self.backend, self.topology = backend, topology
        self.header = Channel(f"{POLICY_WEIGHTS}/header", ChannelKind.BROADCAST, [0], topology.generator_ranks, topology)
        self.last_seconds = 0.0  # the transfer itself
        self.last_wait_seconds = 0.0  # waiting for the other side to reach the channel

    def communicate_with(self, executor) -> None:
        start = time.perf_counter()
        if self.topology.role == "trainer":
            out = executor.get_output(POLICY_WEIGHTS)
            version = None if out is None else out[1]
            if self.topology.rank == 0:
                self.header.communicate(version)
            ready = time.perf_counter()
            if out is not None:
                self.backend.send(out[0])
        else:
            version = self.header.communicate(None)
            ready = time.perf_counter()
            if version is not None:
                executor.put_input(POLICY_WEIGHTS, (version, self.backend.receive()))
        self.last_wait_seconds = ready - start
        self.last_seconds = time.perf_counter() - ready
