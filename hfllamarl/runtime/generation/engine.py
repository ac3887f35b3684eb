"""The generator's vLLM engine: how it is built, how weights go in, and how to check what it holds.

vLLM runs in-process (`vllm.LLM`, no engine subprocess), with `external_launcher` when the
generator world has several ranks (tensor parallelism across them). New weights are loaded in place
with vLLM's `reload_weights`, streaming from the weight sync. `verify_against_disk` is the
independent check of a sync: vLLM's own loader reads the same weights from files and the engine's
parameters must come out bitwise the same.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from hfllamarl.runtime.world.collector import collector_paused


class WeightSyncMismatch(RuntimeError):
    """The generator's engine does not hold what vLLM's own loader gives for the same weights."""


def import_vllm():
    """Import vLLM as the generator runs it (the engine in this process, no compile-worker pool, warnings only),
    and the worker module it loads when an engine starts; returns `vllm.LLM`. A generator child started ahead of
    `train()` calls it while it waits for its job (`hfllamarl.runtime.world.spawn.Prestarted`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine stays in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # No compile-worker pool: its spawned processes would re-import the user's script. (torch's inductor reads
    # this when it is imported, which vLLM does.)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    from vllm import LLM

    try:  # the platform's worker (its model runner, the model loader): an engine's build imports it first thing
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname

        resolve_obj_by_qualname(_worker_class(current_platform))
    except Exception:  # noqa: BLE001 - only a head start: the engine's build imports what it needs anyway
        return LLM
    if current_platform.is_cpu():
        _kernel_overrides_once(type(current_platform))
    return LLM


def _kernel_overrides_once(platform_cls) -> None:
    """vLLM's CPU platform registers its C++ stand-ins for some Triton kernels in every worker's init, by scanning
    every attribute of every loaded module (about 0.6 s of a core here, more the more modules the process holds);
    registered twice in one process, its wrappers would wrap wrappers. Registered here once per process, while a
    generator warms (before its job arrives: off the critical path of a prestarted or preloaded child), after
    which vLLM's own call does nothing. Modules imported later take the stand-ins from the kernels' own modules."""
    if platform_cls.__dict__.get("_hfllamarl_overrides_registered"):
        return
    platform_cls.register_triton_kernel_overrides()
    platform_cls.register_triton_kernel_overrides = classmethod(lambda cls: None)
    platform_cls._hfllamarl_overrides_registered = True


def _worker_class(platform) -> str:
    """The qualified name of the worker class vLLM's engine builds on this platform (the CPU's, or the CUDA one)."""
    return "vllm.v1.worker.cpu_worker.CPUWorker" if platform.is_cpu() else "vllm.v1.worker.gpu_worker.Worker"


@collector_paused()  # (vLLM's import and the engine's build)
def build_engine(model_path: str, tokenizer_path: str, *, dtype: str, seed: int, max_model_len: int,
                 tensor_parallel_size: int, distributed: bool, use_cpu: bool, enforce_eager: bool = True,
                 quantization: str | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.3, load_format: str | None = None, engine_id: str = "", **extra):
    """An in-process `vllm.LLM` whose log-probs are those of the distribution it samples from. `engine_id` names
    this engine among the others of the machine (replicas, other jobs): see `_cpu_shm_names`."""
    LLM = import_vllm()

    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=tokenizer_path,
        dtype=dtype,
        seed=seed,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        logprobs_mode="processed_logprobs",  # after penalties, temperature, top-k/top-p/min-p: what is sampled
    )
    if quantization:  # quantized at load and again at every weight reload (vLLM's layerwise reload)
        kwargs["quantization"] = quantization
    if load_format:
        kwargs["load_format"] = load_format
    kwargs.update(extra)
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
        if use_cpu:
            _cpu_shm_names(engine_id)
            import atexit

            from hfllamarl.runtime.world.processes import release_cpu_shm

            atexit.register(release_cpu_shm, f"{engine_id}_")  # (a generator child calls it itself: `os._exit`)
    if use_cpu:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes or (256 << 20)
        if extra.get("enable_lora"):  # vLLM's CPU LoRA ops, grouped by adapter (lora_adapters.cpu_lora_kernels)
            from hfllamarl.runtime.weights.lora_adapters import cpu_lora_kernels

            cpu_lora_kernels()
        if enforce_eager:
            _eager_token_ranks()
        if "kernel_config" not in kwargs:
            priority = _cpu_norm_kernels()
            if priority:  # (a vLLM without these ops has no such setting either)
                kwargs["kernel_config"] = {"ir_op_priority": priority}
    else:  # pragma: no cover - needs a GPU
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    # vLLM collects garbage five times while it starts (around the model load, then to freeze its heap); each full
    # collection walks every object the imports made (vLLM, torch, transformers: about 0.25 s apiece on a CPU core).
    # Those objects live as long as the process: collected once here (no garbage is kept) and frozen, vLLM's
    # collections skip them (about 1 s less per start-up, whatever the model's size).
    gc.collect()
    gc.freeze()
    _model_classes_in_process(model_path)
    try:
        return LLM(**kwargs)
    except RuntimeError as exc:
        if "create shm in SHMManager failed" in str(exc) and "17" in str(exc):
            raise RuntimeError(
                f"{exc}: vLLM's CPU backend joins a tensor-parallel engine's ranks through shared memory named after "
                f"the engine (/dev/shm/*-cpushm*, here ending in '-{engine_id}': the job's port, its number and the "
                "replica), and a segment of that name exists already: a job killed while its engine ran left it "
                "behind. Remove those files once no vLLM process uses them.") from exc
        raise


def _model_classes_in_process(model_path: str) -> None:
    """Let vLLM read what its model classes support (`_ModelInfo`) in this process, not in a new one. For a model
    class it has not imported, vLLM answers from a file cache (`$VLLM_CACHE_ROOT/modelinfos`) or, on a miss, runs a
    Python subprocess that imports vLLM again to inspect the class: 8 s of a 2-core machine's engine build on the
    first run in a fresh home (a new container, a CI job, a cluster node), against 0.7 s with the cache warm. That
    subprocess keeps CUDA out of a process that forks workers; this engine runs in this process and imports the class
    to build the model anyway. So each architecture in the model's config.json that vLLM implements is registered
    here with its class (vLLM's public `ModelRegistry.register_model`), and is inspected on the spot. An
    architecture vLLM does not know, a hub id, or a class that fails to import is left to vLLM, which says why."""
    import json

    from vllm import ModelRegistry

    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return
    for arch in architectures:
        if arch not in ModelRegistry.get_supported_archs():
            continue
        try:
            ModelRegistry.register_model(arch, ModelRegistry.models[arch].load_model_cls())
        except Exception:  # noqa: BLE001 - vLLM's own path imports it again and reports the failure
            continue


def _eager_token_ranks() -> None:
    """Eager mode on the CPU, whole: vLLM's sampler counts each sampled token's rank with a `torch.compile`d
    function even under `enforce_eager`, and on the CPU inductor builds (or loads and links) C++ for it in every
    engine's first batch that asks for log-probs: about 2 s of each generator's start-up, for a comparison and a
    sum that run as fast eagerly at the batch sizes a generator samples. Its eager original is used instead (the
    same operations, so the same counts). On a GPU vLLM's compiled kernel is kept."""
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


CPU_NORM_PROVIDER = "hfllamarl_cpu"


def _cpu_norm_kernels() -> dict[str, list[str]]:
    """vLLM's RMS norms on the CPU as its compiled kernels, as on a GPU. vLLM dispatches `rms_norm` and
    `fused_add_rms_norm` by a priority of providers; on a GPU its C++ kernels come first, on the CPU only the native
    one (a dozen tensor operations a call, each dispatched from Python), although the CPU build has the kernels
    (`torch.ops._C`). On the bench's model (16 rows a decoding step, one core) the native norms were 8.6 % of
    generation and the kernels take 3.8 %. Registered here as a provider of their own, ahead of the native one,
    which still serves what the kernels do not take (a weight of another dtype, a variance over part of the
    hidden size, a strided view). The kernels scale in fp32 and round once, as vLLM's GPU kernels do. Returns the
    priority lists for `KernelConfig.ir_op_priority` (empty where this vLLM has no such ops or kernels)."""
    try:
        from vllm import _custom_ops  # noqa: F401 - loads torch.ops._C
        from vllm import ir
    except ImportError:
        return {}
    kernels = getattr(torch.ops, "_C", None)
    if kernels is None or not (hasattr(kernels, "rms_norm") and hasattr(kernels, "fused_add_rms_norm")):
        return {}
    ops = getattr(ir, "ops", None)
    if ops is None or not all(hasattr(ops, name) for name in ("rms_norm", "fused_add_rms_norm")):
        return {}
    if CPU_NORM_PROVIDER not in ops.rms_norm.impls:
        _register_cpu_norms(ops)
    return {"rms_norm": [CPU_NORM_PROVIDER], "fused_add_rms_norm": [CPU_NORM_PROVIDER]}


def _register_cpu_norms(ops) -> None:
    # (the annotations are read by torch's schema inference, from this module's globals: torch.Tensor)
    def plain(x, weight, variance_size):  # what the kernels take: a whole contiguous row and a weight of its dtype
        return variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()

    @ops.rms_norm.register_impl(CPU_NORM_PROVIDER, supported=True,
                                supports_args=lambda x, weight, epsilon, variance_size=None: plain(
                                    x, weight, variance_size))
    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                 variance_size: int | None = None) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, epsilon)
        return out

    @ops.fused_add_rms_norm.register_impl(CPU_NORM_PROVIDER, supported=True, inplace=True,
                                          supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: (
                                              plain(x, weight, variance_size)
                                              and x_residual.is_contiguous() and x_residual.dtype == x.dtype))
    def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
        return x, x_residual


def _cpu_shm_names(engine_id: str) -> None:
    """vLLM's CPU backend joins the ranks of a tensor-parallel engine by a shared-memory segment named after the
    engine's init method and group ranks, which under the external launcher are the same for every engine
    ("env://", ranks 0..m-1): a second engine on the machine (another replica, another job) fails to create it
    (`create shm in SHMManager failed. errno: 17`). The name gets this engine's id appended (every rank of an
    engine passes the same id)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is None or not hasattr(shm, "make_group_name"):
        return  # another vLLM: nothing to rename
    os.environ["HFLLAMARL_ENGINE_ID"] = engine_id
    original = getattr(shm.make_group_name, "_hfllamarl_original", shm.make_group_name)

    def make_group_name(communicator) -> str:
        return f"{original(communicator)}-{os.environ.get('HFLLAMARL_ENGINE_ID', '')}"

    make_group_name._hfllamarl_original = original
    shm.make_group_name = staticmethod(make_group_name)


def load_weights(llm, weights) -> None:
    """Load `(name, tensor)` pairs (Hugging Face names, full-size tensors) into the engine in place."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()


def loader_boxes(llm, weights: list[tuple[str, tuple[int, ...]]]) -> dict:
    """For each Hugging Face weight, the box this rank's engine reads of it (`hfllamarl.runtime.generation.loader_regions`)."""
    from hfllamarl.runtime.generation.loader_regions import read_regions

    return llm.apply_model(lambda model: read_regions(model, weights))[0]


def fingerprint(model: torch.nn.Module, rows: int = 2) -> dict[str, torch.Tensor]:
    """What the engine computes with: every parameter and buffer it keeps as a tensor, and for every linear
    layer its output on a fixed random input. (vLLM's CPU backend repacks linear weights into kernel
    handles and leaves an empty `weight`; the output of `quant_method.apply` is the same whatever the
    packing, and differs if any weight it uses differs.)"""
    out = {}
    generator = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        for key, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and t.numel():
                out[f"{name}.{key}"] = t.detach().clone()
        width = getattr(module, "input_size_per_partition", None)
        method = getattr(module, "quant_method", None)
        if width and method is not None and hasattr(method, "apply"):
            weight = next((t for t in module._parameters.values() if t is not None), None)
            device = weight.device if weight is not None else torch.device("cpu")
            dtype = getattr(module, "params_dtype", torch.float32)
            x = torch.randn(rows, width, generator=generator).to(device, dtype)
            with torch.no_grad():
                out[f"{name}(x)"] = method.apply(module, x).detach().clone()
    return out


def verify_against_disk(llm, directory: str) -> list[str]:
    """Reload the weights saved in `directory` with vLLM's own loader and compare what the engine computes
    with (`fingerprint`) before and after, bitwise. Returns one line per tensor that differs (empty: the
    engine held exactly those weights). The engine keeps the weights loaded from `directory`."""
    before = llm.apply_model(fingerprint)[0]
    llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
    llm.reset_prefix_cache()
    after = llm.apply_model(fingerprint)[0]
    bad = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None or old.shape != new.shape:
            bad.append(f"{name}: {None if old is None else tuple(old.shape)} vs {None if new is None else tuple(new.shape)}")
        elif not torch.equal(old, new):
            differ = old != new
            nan = int(torch.isnan(old).sum())
            finite = differ & torch.isfinite(old) & torch.isfinite(new)
            worst = float((old[finite].float() - new[finite].float()).abs().max()) if bool(finite.any()) else 0.0
            bad.append(f"{name}: {int(differ.sum())} of {new.numel()} values differ (max |diff| {worst:.3g}"
                       f"{f', {nan} NaN in the synced engine' if nan else ''})")
    return bad
