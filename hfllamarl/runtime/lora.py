"""LoRA through `peft_config`: the trainer trains adapters, the generator gets merged weights.

The trainer ranks wrap the policy with peft (`get_peft_model`) before FSDP2 sharding, so the optimizer
holds only the adapters' states. The generator never sees an adapter: at every sync it receives, for
each adapted linear layer, the merged weight `W + scaling * B @ A` under the model's own (Hugging Face)
name, and nothing for the layers no adapter touches. vLLM fuses some projections into one layer
(q, k and v into `qkv_proj`; gate and up into `gate_up_proj`) and reloads a layer only whole, so the
siblings of an adapted projection travel with it (their weights unchanged when they carry no adapter).

FSDP2 shards `W`, `B` and `A` on dim 0 over the same trainer ranks; `W` and `B` share their first
dimension (out_features), so each rank merges its own rows: `W_local + scaling * B_local @ A_full`,
with only the small `A` (rank x in_features) gathered. The merged weight keeps `W`'s sharding, so every
weight-sync backend sends it as it sends a plain policy's shards.
"""

from __future__ import annotations

import torch

# vLLM's fused layers (Llama family): an adapted projection brings its siblings along.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PREFIX = "base_model.model."


def apply_peft(model: torch.nn.Module, peft_config) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters; refuse peft settings the merged-weight sync cannot honour."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is a dependency
        raise ImportError("peft_config needs the `peft` package: pip install peft") from exc
    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"peft_config must be a peft.LoraConfig (got {type(peft_config).__name__}): the generator "
                         "receives merged LoRA weights; other peft methods are not supported.")
    for field, bad, why in (("modules_to_save", lambda v: bool(v), "fully trained extra modules"),
                            ("use_dora", lambda v: bool(v), "DoRA's magnitude vector"),
                            ("bias", lambda v: v != "none", "trained biases")):
        if bad(getattr(peft_config, field, None)):
            raise ValueError(f"peft_config.{field}={getattr(peft_config, field)!r} is not supported ({why} do not "
                             "reach the generator as a merged weight); leave it at its default.")
    return get_peft_model(model, peft_config)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    """HF module name -> peft LoRA layer wrapping an nn.Linear."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and isinstance(module.get_base_layer(), torch.nn.Linear):
            out[name.removeprefix(_PREFIX)] = module
    return out


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W + scaling * B @ A`: the one merge formula, for a whole weight or a shard of W's and B's rows."""
    return weight + scaling * (b @ a.to(b.dtype))


def _merged(layer) -> torch.Tensor:
    """`W + scaling * B @ A` for the active adapter, sharded like `W` (a DTensor under FSDP2)."""
    weight = layer.get_base_layer().weight
    adapter = layer.active_adapters[0]
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    scaling = layer.scaling[adapter]
    if not hasattr(weight, "to_local"):
        return _merge(weight, a, b, scaling).detach()
    from torch.distributed.tensor import DTensor

    a_full = a.full_tensor() if hasattr(a, "full_tensor") else a
    b_local = b.to_local() if hasattr(b, "to_local") else b
    local = _merge(weight.to_local(), a_full, b_local, scaling)
    return DTensor.from_local(local.detach(), weight.device_mesh, weight.placements, shape=weight.shape,
                              stride=weight.stride())


class MergedLoraWeights:
    """What the weight-sync backends send for a LoRA policy: `state_dict()` maps HF names of the adapted
    layers (and their fused siblings) to merged weights. Computing it is a collective over the trainer
    world (each `A` is gathered), so every trainer rank calls it, in the same order."""

    def __init__(self, model):
        self.model = model
        layers = _lora_layers(model)
        if not layers:
            raise ValueError("peft_config adapts no nn.Linear layer of the policy; check target_modules.")
        names = set(layers)
        for name in list(layers):
            parent, _, leaf = name.rpartition(".")
            for group in FUSED:
                if leaf in group:
                    names |= {f"{parent}.{sibling}" for sibling in group}
        modules = dict(model.named_modules())
        self._layers = {}
        for name in sorted(names):
            module = layers.get(name) or modules.get(_PREFIX + name)
            if module is None:
                raise ValueError(f"{name!r} is fused with an adapted layer in vLLM but the policy has no such layer")
            self._layers[name] = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, module in self._layers.items():
            if hasattr(module, "lora_A"):
                out[f"{name}.weight"] = _merged(module)
            else:
                out[f"{name}.weight"] = module.weight.detach()
        return out


def merged_layers(model) -> dict[str, object]:
    """HF weight name of every adapted layer -> a function returning its merged weight (sharded like `W`)."""
    return {f"{name}.weight": (lambda layer=layer: _merged(layer)) for name, layer in _lora_layers(model).items()}
