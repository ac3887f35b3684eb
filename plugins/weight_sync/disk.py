"""`disk` weight sync: trainer rank 0 writes the full weights as safetensors; generators read them.

For generator clusters with no direct link to the trainers (a shared file system is enough).
Every trainer rank takes part in materialising each full tensor (an all-gather of its FSDP2
shards); rank 0 writes one file atomically (a temporary name, then a rename) and tells the
generators its path over the object bridge; each generator streams the tensors from the file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch

from hfllamarl.contracts import WeightSyncBackend
from hfllamarl.weight_sync import recv_object, settle, start_send_object

from .broadcast import full_tensor


class DiskWeightSync(WeightSyncBackend):
    """Options: `directory` (default: a new temporary directory on trainer rank 0)."""

    def __init__(self, topology, directory: str | None = None, **options):  # options: see WeightSyncBackend
        super().__init__(topology, **options)
        self.directory = directory
        self.version = 0

    def send(self, model: torch.nn.Module) -> None:
        from safetensors.torch import save_file

        topo = self.topology
        tensors = {name: full_tensor(t).to(self.wire_dtype(t.dtype)).cpu().contiguous()
                   for name, t in model.state_dict().items()}
        if topo.rank != 0:
            return
        if self.directory is None:
            self.directory = tempfile.mkdtemp(prefix="hfllamarl-weights-")
        os.makedirs(self.directory, exist_ok=True)
        self.version += 1
        path = os.path.join(self.directory, f"policy-{self.version}.safetensors")
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)  # a reader never sees a half-written file
        settle([w for dst in self.target_ranks if topo.replica_of(dst) not in topo.lost
                for w in start_send_object(topo, path, dst, "disk weight sync")])
        previous = os.path.join(self.directory, f"policy-{self.version - 1}.safetensors")
        if os.path.exists(previous):
            os.remove(previous)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        path = recv_object(self.topology, 0, "disk weight sync")
        with safe_open(path, framework="pt", device=str(self.device)) as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
