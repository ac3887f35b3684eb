"""LoRA's adapter-only sync: the generator's vLLM engine keeps the base weights and loads each policy version's
adapters into its own LoRA support, so a sync moves the adapters (megabytes) instead of every adapted layer merged
(with LoRA on every linear layer, the whole model).

`lora_sync` chooses between this and the merged sync (`hfllamarl.runtime.weights.lora`). With 'auto', adapters travel
alone on GPUs when the engine can apply them exactly as the trainer does; otherwise the merged weights do, and the
log says why (`choose_lora_sync`). On the CPU 'auto' keeps the merged sync: applying adapters made a generation batch
twice as long on the bench's model (`hfllamarl bench lora-sync`, with `cpu_lora_kernels`), far more than the sync
saves there. The choice is made from the configuration alone, identically on every process of the job.

What travels (`AdapterWeights`): for every adapted linear layer, `A` and `scaling * B` under peft's file names
(`base_model.model.<layer>.lora_A.weight`), still sharded as FSDP2 holds them, so every weight-sync backend sends
them as it sends a plain policy's shards, each trainer rank its own rows. The scaling goes into `B`, and the adapter
is written with `lora_alpha = r` (vLLM's scaling is then 1): per-layer `alpha_pattern` and rsLoRA come out exactly
as peft computes them.

On the generator (`AdapterSlot`): the received tensors are written as a peft adapter directory (a private scratch
directory; the previous version's is removed) and registered with the engine under an id that names the policy
version; every request the generator makes then carries it. One adapter is live at a time (a generator samples a
tick with one policy version), so the engine holds one slot.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import torch

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the LoRA ranks vLLM's engine accepts (`max_lora_rank`)
# Families whose adapter sync is checked against the merged weights (tests/test_lora.py: pi/mu == 1 after a sync on
# each, verify_weight_sync from two FSDP2 ranks). Others take the merged sync under 'auto'.
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_EMBEDDINGS = ("embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out", "word_embeddings", "output")
SYNC_MODES = ("auto", "adapter", "merged")


def choose_lora_sync(requested: str, peft_config, model_obj, model_config, *, use_cpu: bool = False,
                     quantization: str | None = None, model_impl: str = "vllm") -> tuple[str, str]:
    """('adapter' or 'merged', why) for a LoRA run; ('none', '') for a run without LoRA. `requested='adapter'` that
    cannot be honoured raises with the reason; 'auto' falls back to 'merged' with it."""
    from hfllamarl.runtime.weights.lora import is_peft

    if requested not in SYNC_MODES:
        raise ValueError(f"lora_sync={requested!r}: choose one of {SYNC_MODES}.")
    lora = peft_config is not None or (model_obj is not None and is_peft(model_obj))
    if not lora:
        if requested == "adapter":
            raise ValueError("lora_sync='adapter' needs a LoRA policy (peft_config, or a peft model with "
                             "`use_peft` in a recipe); leave lora_sync at 'auto' for a full-weight run.")
        return "none", ""
    if requested == "merged":
        return "merged", "lora_sync='merged'"
    why = _cannot_load_adapters(peft_config, model_obj, model_config, quantization, model_impl)
    if why is None and use_cpu and requested == "auto":
        why = ("on the CPU, applying adapters in vLLM costs more generation time than the merged sync saves (measured "
               "with `hfllamarl bench lora-sync`: a batch twice as long); lora_sync='adapter' sends the adapters alone")
    if why is None:
        return "adapter", "the engine loads each version's adapters (vLLM's LoRA support)"
    if requested == "adapter":
        raise ValueError(f"lora_sync='adapter' cannot be honoured: {why}. Use lora_sync='auto' or 'merged' (the "
                         "generator then receives the adapted layers merged).")
    return "merged", why


def _cannot_load_adapters(peft_config, model_obj, model_config, quantization, model_impl) -> str | None:
    if peft_config is None:
        return ("the policy is a PeftModel whose adapters are trained as given: the engine starts from the merged "
                "policy, on which adapters cannot be applied again")
    init = getattr(peft_config, "init_lora_weights", True)
    if init not in (True, "gaussian"):
        return (f"init_lora_weights={init!r} starts with a non-zero adapter or changes the base weights, which the "
                "engine loads from the model's files")
    if getattr(peft_config, "rank_pattern", None):
        return "rank_pattern gives layers ranks of their own"
    if peft_config.r > VLLM_RANKS[-1]:
        return f"r={peft_config.r} is above the largest rank vLLM's LoRA support takes ({VLLM_RANKS[-1]})"
    targets = peft_config.target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    if any(n in _EMBEDDINGS for n in names) or (isinstance(targets, str) and targets != "all-linear"):
        return (f"target_modules={targets!r} may adapt an embedding or output layer (or is a pattern): vLLM "
                "applies adapters to linear layers here")
    if quantization:
        return f"generator_quantization={quantization!r}"
    if model_impl != "vllm":
        return f"vllm_model_impl={model_impl!r}"
    arch = (getattr(model_config, "architectures", None) or ["?"])[0]
    if arch not in FAMILIES:
        return (f"{arch} is not among the families whose adapter sync is checked against the merged weights "
                f"({', '.join(FAMILIES)}); lora_sync='adapter' tries vLLM's LoRA support on it")
    return None


def engine_rank(peft_config) -> int:
    """vLLM's `max_lora_rank` for this adapter: the smallest rank it accepts that holds `r`."""
    return next(r for r in VLLM_RANKS if r >= peft_config.r)


def adapter_config(peft_config) -> dict:
    """adapter_config.json as vLLM reads it, for adapters whose scaling is already in `B` (lora_alpha = r)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(peft_config.r), "lora_alpha": int(peft_config.r),
            "use_rslora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "lora_dropout": 0.0}


class AdapterWeights:
    """What the weight sync sends under lora_sync='adapter': `state_dict()` maps peft's file names to `A` and
    `scaling * B` of every adapted linear layer (FSDP2-sharded like the parameters). `merged` is the merged-layer
    view of the same policy, which verify_weight_sync exports for the engine's own loader."""

    def __init__(self, model):
        from hfllamarl.runtime.weights.lora import MergedLoraWeights, _lora_layers

        self.model = model
        self._layers = _lora_layers(model)
        refused = [n for n, m in self._layers.items() if not isinstance(m.get_base_layer(), torch.nn.Linear)]
        if refused:
            raise ValueError(f"lora_sync='adapter': {refused[:3]} are not linear layers; vLLM's LoRA support adapts "
                             "linear layers here. Drop them from target_modules or use lora_sync='merged'.")
        self.merged = MergedLoraWeights(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in self._layers.items():
            adapter = layer.active_adapters[0]
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A[adapter].weight.detach()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (layer.lora_B[adapter].weight * layer.scaling[adapter]).detach()
        return out


def engine_options(rank: int) -> dict:
    """What `vllm.LLM` takes to hold one adapter of `rank` at a time."""
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 1}


class AdapterSlot:
    """The generator's adapter: the policy version it names, the request every `generate` call carries."""

    def __init__(self, llm, config: dict, start: str | None = None, version: int = 0):
        self.llm, self.config = llm, config
        from hfllamarl.runtime.world.processes import sweep_dead_owners

        sweep_dead_owners("hfllamarl-lora-")  # (what a generator that left by os._exit or SIGKILL kept)
        self.scratch = tempfile.mkdtemp(prefix=f"hfllamarl-lora-{os.getpid()}-")
        self.request = None
        self.bytes = 0
        if start is not None:  # a resumed run: the checkpoint's adapters, in peft's own format (scaling in its config)
            self._register(version, start, own=False)

    def load(self, version: int, weights) -> None:
        """Write the received (name, tensor) pairs as version `version`'s adapter and make it the live one."""
        from safetensors.torch import save_file

        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights}
        directory = os.path.join(self.scratch, f"version-{version}")
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
        # (the layers peft adapted, whichever way target_modules named them: read off the tensors received)
        targets = sorted({name.rsplit(".", 3)[1] for name in tensors})
        with open(os.path.join(directory, "adapter_config.json"), "w") as fh:
            json.dump({**self.config, "target_modules": targets}, fh)
        self.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._register(version, directory, own=True)

    def _register(self, version: int, directory: str, own: bool) -> None:
        from vllm.lora.request import LoRARequest

        previous = self.request
        request = LoRARequest(f"policy-version-{version}", version + 1, directory)
        engine = self.llm.llm_engine
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of policy version {version} ({directory}).")
        self.request = request
        self.llm.reset_prefix_cache()  # (cached prefixes were computed under the previous adapter)
        if previous is not None and previous.lora_path.startswith(self.scratch):
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def verify(self, merged_dir: str, base_dir: str, tolerance: float) -> list[str]:
        """verify_weight_sync: the engine's log-probs of a fixed token sequence under the adapter equal (to
        `tolerance`) those it computes after vLLM's own loader reads the merged layers the trainer exported; the
        base weights are then read back from `base_dir`. Returns the differences (empty: the adapter is the policy)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        config = self.llm.llm_engine.model_config
        vocab, length = config.get_vocab_size(), min(48, config.max_model_len - 1)
        ids = [int(i) for i in torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(0))]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

        def logprobs(request) -> torch.Tensor:
            out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, lora_request=request,
                                    use_tqdm=False)[0]
            return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])

        adapted = logprobs(self.request)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": merged_dir})
        self.llm.reset_prefix_cache()
        merged = logprobs(None)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": base_dir})
        self.llm.reset_prefix_cache()
        worst = float((adapted - merged).abs().max())
        if worst <= tolerance:
            return []
        return [f"log-probs of a fixed {length}-token sequence under the adapter differ from the merged weights' "
                f"by up to {worst:.3g} (tolerance {tolerance:g})"]

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _by_index(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor | None:
    """Row t of the result is `inputs[t] @ weights[indices[t]]^T` (what vLLM's CPU LoRA ops compute with one copy of
    the adapter matrix per token): one matrix product per distinct index instead (a batch uses one adapter here;
    vLLM marks a token without adapter with index -1, which indexes here as it does there).
    None where the shapes are not those (the caller then runs vLLM's own op)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    if weights.dim() != 3 or indices.dim() != 1 or indices.numel() != inputs.shape[0]:
        return None
    inputs = inputs.to(dtype)
    distinct = torch.unique(indices).tolist()
    if len(distinct) == 1:
        return inputs @ weights[distinct[0]].to(dtype).T
    out = inputs.new_empty(inputs.shape[0], weights.shape[1])
    for index in distinct:
        rows = indices == index
        out[rows] = inputs[rows] @ weights[index].to(dtype).T
    return out


def _store(view: torch.Tensor, value: torch.Tensor, add: bool) -> None:
    """`view += value` or `view[...] = value`, in place (a slice of vLLM's output buffer)."""
    if add:
        view += value
    else:
        view.copy_(value)


def cpu_lora_kernels() -> None:
    """vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`) gather, for every token, a copy of its adapter's matrix and
    multiply token by token: on the bench's model a generation batch took 2.8x as long as on merged weights (2.0x
    with these). They are replaced, once per process, by the same products grouped by adapter (`_by_index`: one
    matrix product per adapter in the batch), with vLLM's own op kept for any shape it is not written for. Applied
    where an engine with LoRA support is built on the CPU."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_hfllamarl_own", None):
        return
    own = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        out = _by_index(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        if out is None:
            return own["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        _store(output_tensor[:, : out.shape[1]], scaling * out, False)

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        out = _by_index(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if out is None or out.shape[0] != output_tensor.shape[0]:
            return own["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        common = min(out.shape[1], output_tensor.shape[1])
        _store(output_tensor[:, :common], out[:, :common], add_inputs)

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        out = _by_index(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if out is None:
            return own["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                                            slice_size, add_inputs)
        _store(output_tensor[:, slice_offset: slice_offset + slice_size], out, add_inputs)

    for module in (lora_ops, punica_cpu):  # (the sgmv ops call these through lora_ops; the wrapper imported them)
        for name, fn in (("bgmv_shrink", bgmv_shrink), ("bgmv_expand", bgmv_expand),
                         ("bgmv_expand_slice", bgmv_expand_slice)):
            setattr(module, name, fn)
    lora_ops._hfllamarl_own = own  # (vLLM's own ops, kept for the shapes above and for comparison)
