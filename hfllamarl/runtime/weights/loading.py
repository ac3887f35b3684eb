"""Loading the policy at real sizes: no trainer rank ever holds the whole model.

The model is built on the meta device (parameters without memory; buffers such as the rotary
frequencies are computed as usual), sharded with FSDP2 there, and only then given memory: each
trainer rank allocates its own rows of every parameter and reads exactly those rows from the
checkpoint's safetensors files (`pread` at the rows' byte offsets: no file is mapped whole, no full
tensor is built). So a rank's memory grows by its shard, about 1/N of the model, plus one tensor's
rows in flight. The reference model (`beta > 0`) is loaded the same way.

LoRA adapters created on the meta device get peft's default initialisation (linear layers: A Kaiming-uniform,
the same on every rank, B zeros; embeddings: A zeros, B standard normal), each rank keeping its rows. A checkpoint this loader cannot read
(another format, weights under names that transformers converts when it loads them) is loaded whole
with `from_pretrained` on every rank instead, and the log says so.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from hfllamarl.runtime.weights.fsdp import held_box

logger = logging.getLogger(__name__)

# What a Hub snapshot of a model fetches: config, weights (safetensors), tokenizer files, the chat template
# (chat_template.jinja, where transformers 5 saves it) and remote code.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.tiktoken"]


def looks_like_hub_id(name: str) -> bool:
    """`org/name`, not a path on this machine."""
    return not os.path.exists(name) and not name.startswith((".", "/", "~")) and name.count("/") == 1


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local directory of the Hugging Face Hub model `repo_id` at `revision` (a branch, tag or commit;
    `model_init_kwargs["revision"]`, as from_pretrained reads it), downloaded on first use (HUB_FILES only)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_PEFT_PREFIX = "base_model.model."


class SafetensorsRows:
    """Reads row ranges of the tensors of a Hugging Face checkpoint directory (one safetensors file or an
    index of several) straight from the files."""

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{directory!r} holds no safetensors weights")
        self.entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _DTYPES:
                    raise ValueError(f"{path}: tensor {key} has dtype {meta['dtype']}, which this loader does not read")
                self.entries[key] = (path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + size + meta["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows `[start, end)` (dim 0) of tensor `name`, in its stored dtype."""
        path, dtype, shape, _ = self.entries[name]
        out = torch.empty((end - start,) + tuple(shape[1:]), dtype=dtype)
        self.read_rows_into(name, start, out)
        return out if shape else out.reshape(())

    def read_rows_into(self, name: str, start: int, out: torch.Tensor, block_bytes: int = 16 << 20) -> None:
        """Fill `out` (`[rows, ...]`) with rows `start ...` of tensor `name`: read straight into `out` when it has
        the stored dtype, else through blocks of at most `block_bytes` (a dtype change costs no second copy)."""
        path, dtype, shape, offset = self.entries[name]
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows = out.shape[0] if out.dim() else 1
        target = out.reshape(rows, row)  # a view of `out` when it is contiguous
        direct = out.dtype == dtype and out.is_contiguous()
        step = max(1, rows) if direct else max(1, block_bytes // (row * dtype.itemsize))
        with open(path, "rb") as fh:
            fh.seek(offset + start * row * dtype.itemsize)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                buf = target[r0:r1] if direct else torch.empty((r1 - r0, row), dtype=dtype)
                raw = buf.reshape(-1).view(torch.uint8).numpy()
                if fh.readinto(raw) != raw.nbytes:
                    raise ValueError(f"{path}: tensor {name} is truncated")
                if not direct:
                    target[r0:r1].copy_(buf)
        if not out.is_contiguous():
            out.copy_(target.view(out.shape))


def build_empty(config, dtype: torch.dtype, attn_implementation: str | None = None,
                trust_remote_code: bool = False) -> torch.nn.Module:
    """The model of `config` with its parameters on the meta device and its buffers computed."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def checkpoint_name(name: str) -> str:
    """The checkpoint's name of a (possibly peft-wrapped) model's parameter."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def readable(model: torch.nn.Module, directory: str) -> list[str]:
    """The model's weights this loader cannot find in `directory` (empty: it can load the model)."""
    try:
        rows = SafetensorsRows(directory)
    except (FileNotFoundError, ValueError) as exc:
        return [str(exc)]
    missing = []
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        key = checkpoint_name(name)
        if key not in rows or tuple(rows.shape(key)) != tuple(p.shape):
            missing.append(key)
    return missing


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a sharded meta-device model memory on `device`, keeping the tensors that already had values."""
    kept = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if not local.is_meta:
            kept[name] = local.detach().clone()
    model.to_empty(device=device)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name in kept:
                (t.to_local() if hasattr(t, "to_local") else t).copy_(kept[name])


def load_shards(model: torch.nn.Module, directory: str) -> None:
    """Fill each rank's rows of every (FSDP2-sharded, materialized) parameter from `directory`."""
    rows = SafetensorsRows(directory)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                continue
            key = checkpoint_name(name)
            if key not in rows:
                raise ValueError(f"{directory!r} holds no weight {key!r} for parameter {name}")
            local, box = held_box(p)
            if all(b == (0, n) for b, n in zip(box[1:], p.shape[1:])):
                rows.read_rows_into(key, box[0][0], local)
            else:  # a block of a tensor-parallel weight: its rows, then its columns
                part = rows.read_rows(key, box[0][0], box[0][1])
                local.copy_(part[(slice(None),) + tuple(slice(s, e) for s, e in box[1:])])


def init_lora(model: torch.nn.Module, seed: int = 0) -> None:
    """peft's default initialisation of every LoRA adapter, on sharded weights, from one generator (so every rank
    draws the same full matrices and keeps its rows): a linear layer's A Kaiming-uniform and B zero; an embedding's
    A zero and B standard normal (`peft.tuners.lora.LoraLayer.reset_lora_parameters`)."""
    generator = torch.Generator().manual_seed(seed)

    def fill(p: torch.Tensor, draw) -> None:
        full = torch.empty(tuple(p.shape))
        draw(full)
        local, box = held_box(p)
        local.copy_(full[tuple(slice(s, e) for s, e in box)].to(local.dtype))

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name:
                bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
                fill(p, lambda t: t.uniform_(-bound, bound, generator=generator))
            elif ".lora_B." in name or ".lora_embedding_A." in name:
                (p.to_local() if hasattr(p, "to_local") else p).zero_()
            elif ".lora_embedding_B." in name:
                fill(p, lambda t: t.normal_(0.0, 1.0, generator=generator))
