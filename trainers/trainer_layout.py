"""The layout fields of `AsyncAIPOConfig` checked: the trainer ranks' tensor parallelism, its sequence parallelism,
FSDP2's shard groups (hybrid sharding), against the processes the launcher started; the generator ranks' replicas."""

from __future__ import annotations


def check_fields(config) -> int:
    """The layout fields' own values (before the topology is known); returns trainer_tensor_parallel_size."""
    from .config import _is_whole

    tp = config.trainer_tensor_parallel_size
    if not _is_whole(tp) or tp < 1:
        raise ValueError(f"AsyncAIPOConfig: trainer_tensor_parallel_size={tp!r}; it must be a whole number >= 1.")
    shard = config.trainer_fsdp_shard_size
    if shard is not None and (not _is_whole(shard) or shard < 1):
        raise ValueError(f"AsyncAIPOConfig: trainer_fsdp_shard_size={shard!r}; it must be a whole number >= 1 "
                         "(or None: shard over every data-parallel trainer rank).")
    sp = config.trainer_sequence_parallel
    if not isinstance(sp, bool) or (sp and tp == 1):
        raise ValueError(f"AsyncAIPOConfig: trainer_sequence_parallel={sp!r}: it splits the sequence inside a "
                         "trainer tensor-parallel group, so it takes True or False, and True needs "
                         "trainer_tensor_parallel_size > 1.")
    return tp


def check_layout(config) -> None:
    """Trainer tensor parallelism needs trainer processes to split: several of them, in whole groups. A single
    process (a notebook, `hfllamarl train --check` of a recipe meant for torchrun) keeps the setting; a trainer
    built there refuses it (`check_processes`). FSDP2's shard groups must divide the data-parallel ranks."""
    tp, shard, topo = config.trainer_tensor_parallel_size, config.trainer_fsdp_shard_size, config._topology
    if topo.mode == "single":
        topo.trainer_tp, topo.trainer_shard = 1, None  # (the one trainer process: nothing to split)
        return
    if topo.num_trainers % tp:
        raise ValueError(
            f"AsyncAIPOConfig: trainer_tensor_parallel_size={tp} does not divide the {topo.num_trainers} trainer "
            f"processes; launch a multiple of {tp} trainer processes (plus {config.num_generator_processes} "
            "generator processes), or change trainer_tensor_parallel_size.")
    dp = topo.num_trainers // tp
    if shard is not None and dp % shard:
        raise ValueError(
            f"AsyncAIPOConfig: trainer_fsdp_shard_size={shard} does not divide the {dp} data-parallel trainer ranks "
            f"({topo.num_trainers} trainer processes / trainer_tensor_parallel_size={tp}); use a divisor of {dp}.")
    topo.trainer_shard = shard if shard is not None and shard < dp else None


def check_processes(config) -> None:
    """Refuse trainer tensor parallelism or shard groups of several ranks where there is one trainer process
    (`python script.py`)."""
    tp = config.trainer_tensor_parallel_size
    shard = config.trainer_fsdp_shard_size or 1
    if shard > 1 and tp == 1 and config._topology.mode == "single":
        raise ValueError(
            f"AsyncAIPOConfig: trainer_fsdp_shard_size={shard} shards over {shard} trainer processes, and `python "
            "script.py` runs one. Launch the script with torchrun or accelerate launch.")
    if tp > 1 and config._topology.mode == "single":
        raise ValueError(
            f"AsyncAIPOConfig: trainer_tensor_parallel_size={tp} needs {tp} trainer processes at least, and "
            "`python script.py` runs one. Launch the script with torchrun or accelerate launch, e.g. "
            f"`torchrun --nproc_per_node {tp + config.num_generator_processes} script.py` ({tp} trainer, "
            f"{config.num_generator_processes} generator processes).")


def check_generator_replicas(config) -> None:
    """The generator layout: num_generator_processes = replicas x generator_tensor_parallel_size (sets the latter
    when it is None, from TRL's vllm_tensor_parallel_size / vllm_data_parallel_size or one engine over all)."""
    from .config import _is_whole

    for name in ("max_staleness", "num_generator_processes", "num_generations"):
        if not _is_whole(getattr(config, name)):
            raise ValueError(f"AsyncAIPOConfig: {name}={getattr(config, name)!r}; it must be a whole number.")
    for name in ("generator_tensor_parallel_size", "vllm_data_parallel_size"):
        value = getattr(config, name)
        if value is not None and (not _is_whole(value) or value < 1):
            raise ValueError(f"AsyncAIPOConfig: {name}={value!r}; it must be a whole number >= 1.")
    n, dp = config.num_generator_processes, config.vllm_data_parallel_size
    if n < 1:
        raise ValueError("AsyncAIPOConfig: num_generator_processes must be >= 1.")
    if config.generator_tensor_parallel_size is None:
        if config.vllm_tensor_parallel_size != 1:
            config.generator_tensor_parallel_size = config.vllm_tensor_parallel_size
        elif dp is not None:
            if n % dp:
                raise ValueError(f"AsyncAIPOConfig: vllm_data_parallel_size={dp} replicas do not split "
                                 f"num_generator_processes={n} evenly; set num_generator_processes to a multiple "
                                 f"of {dp}.")
            config.generator_tensor_parallel_size = n // dp
        else:  # one engine across all generator ranks
            config.generator_tensor_parallel_size = n
    tp = config.generator_tensor_parallel_size
    if n % tp:
        raise ValueError(
            f"AsyncAIPOConfig: num_generator_processes ({n}) must be a multiple of generator_tensor_parallel_size "
            f"({tp}): the generator processes form replicas of {tp} ranks each (e.g. num_generator_processes="
            f"{(n // tp + 1) * tp} for {n // tp + 1} replicas).")
    if dp is not None and dp != n // tp:
        raise ValueError(
            f"AsyncAIPOConfig: vllm_data_parallel_size={dp} replicas, but num_generator_processes={n} with "
            f"generator_tensor_parallel_size={tp} make {n // tp}: set vllm_data_parallel_size={n // tp}, or "
            f"num_generator_processes={dp * tp} for {dp} replicas of {tp}.")
    if config.generator_failure not in ("stop", "continue"):
        raise ValueError(f"AsyncAIPOConfig: generator_failure must be 'stop' or 'continue', not "
                         f"{config.generator_failure!r}.")
