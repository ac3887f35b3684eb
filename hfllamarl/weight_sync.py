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

Box = tuple[tuple[int, int], ...]  # one [start, end) per dimension of a weight


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

    def setup_generator(self, loader_boxes=None) -> None:
        """Called once on every generator rank, after its vLLM engine is built, before the first receive.
        `loader_boxes(weights)`, given `[(name, shape)]`, returns for each weight the box this rank's engine
        reads (None: none of it), from vLLM's own loaders; a backend may use it to send each rank only that."""

    def send(self, model: torch.nn.Module) -> None:
        """Called on every trainer rank each time new weights go out."""
        raise NotImplementedError

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Called on every generator rank each time new weights come in: yields (HF name, full-size tensor)
        for the whole weight set, in order, as the tensors arrive."""
        raise NotImplementedError

    def region(self, name: str, generator_rank: int) -> Box | None:
        """Called by checks: the box of weight `name` that `generator_rank` receives valid data for (None for
        the whole tensor)."""
        return None

    def receives(self, name: str, generator_rank: int) -> bool:
        """Called by checks: whether `receive()` on `generator_rank` yields weight `name` at all."""
        return True


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
