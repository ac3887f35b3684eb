"""The policy-weights channel and the interface of weight-sync backends.

A backend (entry point group `hfllamarl.weight_sync`) moves the trainer's policy weights to the
generator ranks. The channel decides *when* (a one-object header from trainer rank 0 says which
policy version follows, or that none does), the backend decides *how*.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .channels import Channel, ChannelKind
from .registry import load_plugin
from .topology import Topology

POLICY_WEIGHTS = "policy_weights"


class WeightSyncBackend:
    """What a weight-sync plugin implements. The entry point names a subclass."""

    def __init__(self, topology: Topology, transfer_dtype: str | torch.dtype | None = None, **options):
        self.topology = topology
        self.options = options
        # Weights travel in this dtype (e.g. bfloat16 for a bf16 generator of an fp32 trainer: half the
        # bytes); None keeps the trainer's. The trainer casts before sending, so what a generator receives
        # is bitwise the trainer's weights cast to it.
        if isinstance(transfer_dtype, str):
            transfer_dtype = None if transfer_dtype == "auto" else getattr(torch, transfer_dtype)
        self.transfer_dtype = transfer_dtype

    @property
    def device(self) -> torch.device:
        """Where this rank's weight buffers live: the CPU, or this process's GPU."""
        if self.topology.use_cpu:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a weight of `dtype` travels in."""
        return self.transfer_dtype or dtype

    def setup_trainer(self, model: torch.nn.Module) -> None:
        """Called once on every trainer rank, after the policy is sharded, before the first send."""

    def setup_generator(self) -> None:
        """Called once on every generator rank, before the first receive."""

    def send(self, model: torch.nn.Module) -> None:
        """Called on every trainer rank each time new weights go out."""
        raise NotImplementedError

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Called on every generator rank each time new weights come in: yields (HF name, full-size tensor)
        for the whole weight set, in order, as the tensors arrive."""
        raise NotImplementedError

    def region(self, name: str, generator_rank: int) -> tuple[int, int, int] | None:
        """Called by checks: the part `(dim, start, end)` of weight `name` that `generator_rank` receives
        (its tensor-parallel shard), or None when it receives the whole tensor."""
        return None


def crop(tensor: torch.Tensor, region: tuple[int, int, int] | None) -> torch.Tensor:
    """The part of `tensor` a `region` (see `WeightSyncBackend.region`) names."""
    if region is None:
        return tensor
    dim, start, end = region
    return tensor.narrow(dim, start, end - start)


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
