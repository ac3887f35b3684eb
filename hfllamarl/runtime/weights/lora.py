"""LoRA through `peft_config` or a `PeftModel`: the trainer trains adapters; the merged sync (lora_sync='merged', and
'auto' where the adapters cannot travel alone: `hfllamarl.runtime.weights.lora_adapters`) gives the generator merged
weights.

The trainer ranks wrap the policy with peft (`get_peft_model`) before FSDP2 sharding, or take a `PeftModel` as the
user built it (its adapters as given, its own config), so the optimizer holds only the adapters' states. Under the
merged sync the generator never sees an adapter: it starts from the merged policy (a model object is saved for it merged, under the
model's own Hugging Face names) and at every sync it receives, for each adapted layer, the merged weight under the
model's own name, and nothing for the layers no adapter touches:

- a linear layer: `W + scaling * B @ A`;
- an embedding: `W + scaling * (B @ A)^T` (peft's `lora_embedding_A` is `[r, vocab]`, `lora_embedding_B` `[dim, r]`).

vLLM fuses some projections into one layer (q, k and v into `qkv_proj`; gate and up into `gate_up_proj`) and reloads a
layer only whole, so the siblings of an adapted projection travel with it (unchanged when they carry no adapter).

FSDP2 shards `W`, `B` and `A` on dim 0 over the same trainer ranks. A linear layer's `W` and `B` share their first
dimension (out_features), so each rank merges its own rows: `W_local + scaling * B_local @ A_full`, with only the small
`A` gathered. An embedding's rows are vocabulary entries, which index `A`'s columns: each rank gathers the small `A`
and `B` and adds `scaling * (B @ A[:, rows])^T` to its rows. The merged weight keeps `W`'s sharding, so every
weight-sync backend sends it as it sends a plain policy's shards.

What cannot reach vLLM as a merged weight is refused when the trainer is built, with the reason: other peft methods,
DoRA, trained biases, `modules_to_save`, `target_parameters`, layers other than linear and embedding ones, and an
adapter on the embedding or output layer of a model whose word embeddings are tied (vLLM holds one matrix for both;
peft adapts only one of them).
"""

from __future__ import annotations

import torch

# vLLM's fused layers (Llama family): an adapted projection brings its siblings along.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PREFIX = "base_model.model."


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def check_peft_inputs(model, peft_config) -> None:
    """Refuse, on every rank at construction, a `model`/`peft_config` pair the merged-weight sync cannot honour."""
    if peft_config is not None and is_peft(model):  # as TRL's GRPOTrainer
        raise ValueError("You passed a PeftModel as `model` together with a `peft_config`. Pass one of them: the "
                         "PeftModel alone (its adapters are trained as they are), or merge and unload its adapters "
                         "(merge_and_unload()), save the base model, and pass that with the new `peft_config`.")
    if peft_config is not None:
        check_lora_config(peft_config)
    if is_peft(model):
        adapters = list(model.peft_config)
        if len(adapters) != 1:
            raise ValueError(f"the PeftModel holds {len(adapters)} adapters {adapters}; the generator receives one "
                             "merged policy: keep one adapter (delete_adapter) or merge the others first.")
        check_lora_config(model.peft_config[adapters[0]])
        if not any(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n):
            raise ValueError("the PeftModel has no trainable adapter weights (PeftModel.from_pretrained loads them "
                             "frozen): load it with is_trainable=True.")
        check_lora_layers(model)


def check_lora_config(peft_config) -> None:
    """Refuse peft settings whose training the generator cannot receive as merged weights."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"peft_config must be a peft.LoraConfig (got {type(peft_config).__name__}): the generator "
                         "receives merged LoRA weights; other peft methods are not supported.")
    for field, bad, why in (("modules_to_save", bool, "fully trained extra modules"),
                            ("use_dora", bool, "DoRA's magnitude vector"),
                            ("target_parameters", bool, "adapters on bare parameters (MoE experts)"),
                            ("bias", lambda v: v not in (None, "none"), "trained biases")):
        if bad(getattr(peft_config, field, None)):
            raise ValueError(f"peft_config.{field}={getattr(peft_config, field)!r} is not supported ({why} do not "
                             "reach the generator as a merged weight); leave it at its default.")


def apply_peft(model: torch.nn.Module, peft_config) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters; refuse peft settings the merged-weight sync cannot honour."""
    try:
        from peft import get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is a dependency
        raise ImportError("peft_config needs the `peft` package: pip install peft") from exc
    check_lora_config(peft_config)
    wrapped = get_peft_model(model, peft_config)
    check_lora_layers(wrapped)
    return wrapped


def _adapted(model) -> dict[str, torch.nn.Module]:
    """HF module name -> every peft LoRA layer of `model` (a PeftModel or a model peft injected adapters into)."""
    from peft.tuners.lora import LoraLayer

    return {name.removeprefix(_PREFIX): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def check_lora_layers(model) -> None:
    """Refuse adapted layers vLLM cannot receive merged: not linear nor embedding, or a tied embedding / lm_head."""
    layers = _adapted(model)
    if not layers:
        raise ValueError("peft_config adapts no layer of the policy; check target_modules.")
    for name, layer in layers.items():
        base = layer.get_base_layer()
        if not isinstance(base, (torch.nn.Linear, torch.nn.Embedding)):
            raise ValueError(f"LoRA on {name!r} ({type(base).__name__}) is not supported: the generator receives "
                             "merged weights of linear and embedding layers only; drop it from target_modules.")
    plain = model.get_base_model() if is_peft(model) else model
    config = getattr(plain, "config", None)
    tied = config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False)
    if tied:
        ends = {id(m) for m in (plain.get_input_embeddings(), plain.get_output_embeddings()) if m is not None}
        for name, layer in layers.items():
            if id(layer) in ends or id(layer.get_base_layer()) in ends:
                raise ValueError(f"LoRA on {name!r} is not supported on a model with tied word embeddings: vLLM holds "
                                 "one matrix for the embedding and the output layer, and peft adapts only one of "
                                 f"them; drop {name.rpartition('.')[2]!r} from target_modules.")


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    """HF module name -> peft LoRA layer wrapping an nn.Linear or an nn.Embedding."""
    return {name: m for name, m in _adapted(model).items()
            if isinstance(m.get_base_layer(), (torch.nn.Linear, torch.nn.Embedding))}


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W + scaling * B @ A`: the one merge formula, for a whole weight or a shard of W's and B's rows."""
    return weight + scaling * (b @ a.to(b.dtype))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _merged_embedding(layer, adapter: str) -> torch.Tensor:
    """`W + scaling * (B @ A)^T` for an embedding, each rank merging its own vocabulary rows of `W`."""
    weight = layer.get_base_layer().weight
    a, b = _full(layer.lora_embedding_A[adapter]), _full(layer.lora_embedding_B[adapter])
    scaling = layer.scaling[adapter]
    if not hasattr(weight, "to_local"):
        return (weight + scaling * (b @ a.to(b.dtype)).T).detach()
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = weight.to_local()
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, tuple(weight.placements))
    start = int(offset[0]) if len(offset) else 0
    rows = local + scaling * (b @ a[:, start:start + local.shape[0]].to(b.dtype)).T
    return DTensor.from_local(rows.detach(), weight.device_mesh, weight.placements, shape=weight.shape,
                              stride=weight.stride())


def _merged(layer) -> torch.Tensor:
    """The merged weight of the active adapter, sharded like `W` (a DTensor under FSDP2)."""
    adapter = layer.active_adapters[0]
    if adapter in layer.lora_embedding_A:
        return _merged_embedding(layer, adapter)
    weight = layer.get_base_layer().weight
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    scaling = layer.scaling[adapter]
    if not hasattr(weight, "to_local"):
        return _merge(weight, a, b, scaling).detach()
    from torch.distributed.tensor import DTensor

    b_local = b.to_local() if hasattr(b, "to_local") else b
    local = _merge(weight.to_local(), _full(a), b_local, scaling)
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
            raise ValueError("peft_config adapts no linear or embedding layer of the policy; check target_modules.")
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
        self._adapted = set(layers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, module in self._layers.items():
            out[f"{name}.weight"] = _merged(module) if name in self._adapted else module.weight.detach()
        return out


def merged_layers(model) -> dict[str, object]:
    """HF weight name of every adapted layer -> a function returning its merged weight (sharded like `W`)."""
    return {f"{name}.weight": (lambda layer=layer: _merged(layer)) for name, layer in _lora_layers(model).items()}


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole (unsharded) policy under its Hugging Face names with every adapter merged: what a generator loads
    from a model object that carries adapters (a PeftModel, or a model peft injected its layers into)."""
    plain = model.get_base_model() if is_peft(model) else model
    out = {}
    for key, tensor in plain.state_dict().items():
        if ".lora_" not in key:
            out[key.replace(".base_layer.", ".")] = tensor
    for name, layer in _lora_layers(plain).items():
        out[f"{name}.weight"] = _merged(layer)
    return out


def has_adapters(model) -> bool:
    """Whether peft adapter layers are inside `model` (a PeftModel, or a model `get_peft_model` wrapped in place)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return any(isinstance(m, LoraLayer) for m in model.modules())
