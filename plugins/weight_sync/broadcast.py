"""`broadcast` weight sync: gather every parameter on trainer rank 0, then send it to each generator.

The baseline most RL frameworks use: every trainer rank takes part in materialising each full
tensor (an all-gather of its FSDP2 shards), and trainer rank 0 alone sends the full tensor to
every generator rank. Simple and correct; its cost grows with the model and lands on one link.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hfllamarl.contracts import WeightSyncBackend
from hfllamarl.weight_sync import recv_object, recv_tensor, send_objects, send_tensor, settle


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly FSDP2-sharded DTensor) parameter; a collective on the trainer world."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


class BroadcastWeightSync(WeightSyncBackend):
    """Trainer rank 0 sends full tensors to every generator rank, one tensor at a time."""

    def setup_trainer(self, model: torch.nn.Module) -> None:
        sd = model.state_dict()
        self.plan = [(name, tuple(t.shape), self.wire_dtype(t.dtype)) for name, t in sd.items()]
        if self.topology.rank == 0:
            send_objects(self.topology, self.plan, self.topology.generator_ranks, "weight sync plan")

    def setup_generator(self, loader_boxes=None) -> None:
        self.plan = recv_object(self.topology, 0, "weight sync plan")

    def send(self, model: torch.nn.Module) -> None:
        topo = self.topology
        for name, tensor in model.state_dict().items():
            full = full_tensor(tensor)
            if topo.rank != 0:
                continue
            full = full.to(self.device, self.wire_dtype(full.dtype))
            settle([send_tensor(topo, full.contiguous(), dst, f"weight sync ({name})") for dst in self.target_ranks
                    if topo.replica_of(dst) not in topo.lost])

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        topo = self.topology
        for name, shape, dtype in self.plan:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            yield name, recv_tensor(topo, buf, 0, f"weight sync ({name})")
