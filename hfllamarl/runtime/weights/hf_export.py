"""Write sharded (FSDP2) weights as Hugging Face safetensors without any rank holding the model.

Every trainer rank walks the weights in the same order; each weight is gathered on its own (a
collective over the trainer world), and rank 0 appends it to the current file, which it writes out
once it reaches `max_shard_bytes`. So rank 0 holds at most one file's worth of full tensors, and
the other ranks one tensor at a time. With more than one file, a `model.safetensors.index.json`
names the file of every weight, as `save_pretrained` writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import torch

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 1 << 30


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly FSDP2-sharded DTensor) weight; a collective on the trainer world."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


def gathered(items: Iterable[tuple[str, torch.Tensor]], cast=None) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full CPU tensor)` for each `(name, sharded tensor)`, one at a time (`cast(dtype)`: the dtype
    to write a weight of `dtype` in)."""
    for name, t in items:
        full = full_tensor(t)
        yield name, full.to("cpu", cast(full.dtype) if cast else full.dtype).contiguous()


def write_safetensors(items: Iterable[tuple[str, torch.Tensor]], directory: str, write: bool,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, metadata: dict | None = None) -> list[str]:
    """Consume `items` (on every rank: they may be collectives) and, where `write`, save them to `directory`
    as safetensors files of at most `max_shard_bytes` (a single tensor may exceed it). Returns the files."""
    from safetensors.torch import save_file

    files: list[str] = []
    weight_map: dict[str, int] = {}
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal current, size
        if current and write:
            name = f".part-{len(files):05d}.safetensors"
            save_file(current, os.path.join(directory, name), metadata={"format": "pt", **(metadata or {})})
            for key in current:
                weight_map[key] = len(files)
            files.append(name)
        current, size = {}, 0

    if write:
        os.makedirs(directory, exist_ok=True)
    seen: set[int] = set()
    for name, tensor in items:
        if tensor.data_ptr() in seen:  # a tied weight (lm_head = embed_tokens): safetensors stores each apart
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        if write:
            current[name] = tensor
        size += nbytes
    flush()
    if not write:
        return []
    if len(files) == 1:  # a single file keeps save_pretrained's single-file name
        os.replace(os.path.join(directory, files[0]), os.path.join(directory, SAFE_WEIGHTS))
        return [SAFE_WEIGHTS]
    final = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for old, new in zip(files, final):
        os.replace(os.path.join(directory, old), os.path.join(directory, new))
    total = 0
    for path in final:
        total += os.path.getsize(os.path.join(directory, path))
    with open(os.path.join(directory, SAFE_INDEX), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}},
                  fh, indent=2)
    return final


def export_weights(weights, directory: str, write: bool, cast=None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write `weights.state_dict()` (an FSDP2-sharded module, or anything with such a `state_dict`) to
    `directory` as Hugging Face safetensors; call on every trainer rank, `write` on one."""
    return write_safetensors(gathered(weights.state_dict().items(), cast), directory, write, max_shard_bytes)


def export_for_verify(sent, verify_dir, version: int, write: bool, cast) -> None:
    """Trainer side of verify_weight_sync: write what the sync of `version` sends (`sent.state_dict()`; for LoRA
    adapters, their merged layers, which the generator compares its adapted engine with) where `verify_dir(version)`
    says, as vLLM's loader reads it from disk, before it is sent; every trainer rank calls it, `write` on one. The
    previous version's files, which the generator checked at the previous sync, go."""
    import shutil

    export_weights(getattr(sent, "merged", sent), verify_dir(version), write=write, cast=cast)
    previous = verify_dir(version - 1)
    if write and os.path.isdir(previous):
        shutil.rmtree(previous, ignore_errors=True)
