"""`hfllamarl train --config recipe.yaml [--field value ...]`: train from a recipe, as `trl grpo --config` does.

The recipe (see `hfllamarl.commands.recipe`) is read, checked and its data set loaded in every process before the
trainer is built; a bad field, a missing column or an unknown reward stops the job there, with the reason.
The command is a script like any other under a launcher:

    hfllamarl train --config examples/recipes/demo_cpu.yaml                     # python: generators are children
    torchrun --nproc_per_node 2 -m hfllamarl.cli train --config ...             # or: torchrun --no-python hfllamarl train ...
    accelerate launch --multi_gpu --num_processes 2 -m hfllamarl.cli train --config ...
    hfllamarl train --config ... --trainer_replica_groups 2 --max_restarts 3   # every replica group, restarted alone
    hfllamarl train --config ... --check                                        # validate only; nothing starts
"""

from __future__ import annotations

import os
import sys


def add_arguments(parser) -> None:
    """Nothing to declare: every argument after `train` is the recipe's (read by `TrlParser`)."""


def run(args) -> int:
    return main(getattr(args, "rest", []))


def main(argv: list[str] | None = None) -> int:
    """Check the recipe, then (without --check) train. Returns the exit code."""
    from .recipe import RecipeError

    argv = sys.argv[1:] if argv is None else list(argv)
    from .replica_launch import groups_to_start, tie_to_supervisor

    tie_to_supervisor()
    if groups_to_start(argv):
        return start_groups(argv)
    try:
        job = prepare_job(argv)
    except RecipeError as exc:
        print(f"hfllamarl train: error: {exc}", file=sys.stderr)
        return 2
    if job["recipe"].script.check:
        print(summary(job))
        return 0
    if job["launch"]:  # (as `trl grpo`: the recipe's processes, started by accelerate, each reads the recipe)
        from .recipe_launch import ENV_OWN_LAUNCH, launch_command

        cmd = launch_command(job["launch"], argv)
        print(f"hfllamarl train: starting {job['recipe'].script.num_processes} processes: "
              f"accelerate launch {' '.join(job['launch'])} -m hfllamarl.cli train ...", file=sys.stderr, flush=True)
        os.execve(cmd[0], cmd, {**os.environ, ENV_OWN_LAUNCH: "1"})
    from .replica_launch import ENV_STANDBY, await_go

    if os.environ.get(ENV_STANDBY) == "1" and not await_go(job):  # (a replica group's standby: `replica_launch`)
        return 0
    train(job)
    return 0


def start_groups(argv: list[str]) -> int:
    """`trainer_replica_groups` > 1 and no group named: check the recipe once (as group 0), then start every group
    and a lighthouse, and restart a group that fails (`replica_launch`). Returns the exit code."""
    from .recipe import RecipeError
    from .replica_launch import Supervisor, check_argv, groups_to_start, raw_fields, restarts_asked

    groups = groups_to_start(argv)
    # torchft logs every quorum at info, a few lines a step, in the lighthouse (here) and in every group; its logger
    # reads this once, when torchft is imported (below)
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        restarts = restarts_asked(argv)
        job = prepare_job(check_argv(argv))
        config, script = job["recipe"].config, job["recipe"].script
        processes = script.num_processes if job["launch"] else 1 + config.num_generator_processes  # (group 0's)
        gpus = 0
        import torch

        if torch.cuda.is_available() and not config.use_cpu:  # (one a process)
            gpus = processes
            other = 1 if config.trainer_replica_shared_generators else gpus  # (a group sharing group 0's: 1)
            need = gpus + (groups - 1) * other
            if torch.cuda.device_count() < need:
                raise RecipeError(f"trainer_replica_groups={groups} groups (group 0 of {gpus} processes, the others of "
                                  f"{other} each) need {need} GPUs on this machine, which has "
                                  f"{torch.cuda.device_count()}; launch each group on its own machines instead (docs: "
                                  "Elastic trainer replicas).")
        from hfllamarl.runtime.training.replica_quorum import import_torchft

        import_torchft()  # (before anything starts: the groups need it, and so does the lighthouse)
    except (RecipeError, ImportError) as exc:
        print(f"hfllamarl train: error: {exc}", file=sys.stderr)
        return 2
    lighthouse = raw_fields(argv).get("torchft_lighthouse") or os.environ.get("TORCHFT_LIGHTHOUSE") or None
    if script.check:
        print(summary(job))
        each = ("group 0 as above, its generators sampling every group's share, and the other "
                f"{groups - 1} as one trainer process each, without generators (trainer_replica_shared_generators)"
                if config.trainer_replica_shared_generators else "each as above")
        print(f"  groups:  {groups} trainer replica groups started here, {each}, restarted up to {restarts} "
              f"time(s) each; lighthouse {lighthouse or 'started here'}")
        return 0
    grace = min(float(config.collective_timeout_s), 300.0)
    return Supervisor(argv, groups, restarts, config.output_dir, several=bool(job["launch"]), grace_s=grace,
                      lighthouse=lighthouse, gpus_per_group=gpus,
                      shared=bool(config.trainer_replica_shared_generators),
                      processes_per_group=processes).run()


def prepare_job(argv: list[str]) -> dict:
    """Everything the trainer is built from, checked: the recipe, the data set(s), rewards, environments, tools."""
    from .recipe import (RecipeError, dry_run_rewards, load_splits, parse_recipe, resolve_environments, resolve_rewards,
                         resolve_tools, run_prepare, to_prompts)

    launched = "WORLD_SIZE" in os.environ  # (building the config rewrites it to the executor's own world)
    if not [a for a in argv if a not in ("--check", "--check=true", "--check=True")]:
        raise RecipeError("no recipe: give one as a YAML file, `hfllamarl train --config recipe.yaml`, and/or as "
                          "flags (`--model_name_or_path ... --dataset_name ... --reward_funcs ...`); "
                          "`hfllamarl train --help` shows how, examples/recipes/ has recipes to start from.")
    from .recipe_launch import resolve

    recipe = parse_recipe(argv)
    script, config, model = recipe.script, recipe.config, recipe.model
    if config.trainer_only and not launched:  # (it shares group 0's generators: one trainer process, no launch)
        script.num_processes, script.accelerate_config = 1, None
    launch = resolve(script, launched)
    check_layout(recipe, launched)
    if model.load_in_4bit or model.load_in_8bit:
        raise RecipeError("load_in_4bit / load_in_8bit: a quantized base model is not supported (the trainer ranks "
                          "shard the policy with FSDP2 and send its weights to vLLM); use LoRA on a bf16 base "
                          "(use_peft: true) instead.")
    rewards = resolve_rewards(script.reward_funcs)
    environments = resolve_environments(script.environments)
    tools = resolve_tools(script.tools)
    if not rewards and environments is None:
        raise RecipeError("reward_funcs is empty: name at least one reward (`hfllamarl plugins list` shows the "
                          "installed ones) or an environment that scores its rollouts.")
    run_prepare(recipe)
    if not model.model_name_or_path:
        raise RecipeError("model_name_or_path is not set: give a local model directory or a Hub id.")
    check_model(model.model_name_or_path, config, model)
    evaluating = config.eval_strategy != "no"
    splits = [script.dataset_train_split] + ([script.dataset_test_split] if evaluating else [])
    train_dataset = eval_dataset = None
    if script.dataset_name or recipe.mixture.datasets or environments is None:  # (an environment may write them)
        loaded = load_splits(script, splits, recipe.mixture)
        train_dataset = to_prompts(loaded[script.dataset_train_split], script)
        if len(train_dataset) == 0:
            raise RecipeError(f"split {script.dataset_train_split!r} of "
                              f"{script.dataset_name if not recipe.mixture.datasets else 'the mixture'!r} has no rows.")
        if evaluating:
            eval_dataset = to_prompts(loaded[script.dataset_test_split], script)
        dry_run_rewards(rewards, train_dataset)
    return dict(recipe=recipe, rewards=rewards, environments=environments, tools=tools, train_dataset=train_dataset,
                eval_dataset=eval_dataset, launch=launch)


def check_model(name: str, config=None, model_args=None) -> None:
    """A local model must be a directory saved with save_pretrained (a Hub id is fetched by the trainer); its shape
    must split over the trainer's and the generator's tensor-parallel sizes (`config`: the recipe's AsyncAIPOConfig),
    checked here as the ranks would check it at start (after the queue, on a cluster)."""
    from hfllamarl.runtime.weights.loading import looks_like_hub_id

    from .recipe import RecipeError

    if looks_like_hub_id(name):
        return
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise RecipeError(f"model_name_or_path {name!r}: not a model directory (no config.json there) and not a Hub "
                          "id (`org/name`); give a directory saved with save_pretrained().")
    if config is None:
        return
    from transformers import AutoConfig

    from hfllamarl.runtime.generation.preflight import PreflightError, check_generator
    from hfllamarl.runtime.weights.tensor_parallel import TensorParallelError, check_trainer_tp

    try:
        hf = AutoConfig.from_pretrained(name, trust_remote_code=config.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - an unreadable config.json is the recipe's to fix
        raise RecipeError(f"model_name_or_path {name!r}: its config.json cannot be read: {exc}") from None
    lora = bool(getattr(model_args, "use_peft", False))
    try:
        check_trainer_tp(hf, config.trainer_tensor_parallel_size, peft_config=True if lora else None)
        dtype = config.generator_dtype if config.generator_dtype != "auto" else ("bfloat16" if config.bf16 else "float32")
        check_generator(hf, use_cpu=config.use_cpu, dtype=dtype,
                        tensor_parallel_size=config.generator_tensor_parallel_size, model_impl=config.vllm_model_impl)
    except (TensorParallelError, PreflightError) as exc:
        raise RecipeError(f"model_name_or_path {name!r}: {exc}") from None


def check_layout(recipe, launched: bool) -> None:
    """The recipe's num_processes, when given, against the generator ranks the config asks for; under a launcher
    (`launched`: WORLD_SIZE was set before the config was built) the processes it started are the layout."""
    from .recipe import RecipeError

    if launched:
        return  # AsyncAIPOConfig checked the layout against the processes the launcher started
    n, g = recipe.script.num_processes, recipe.config.num_generator_processes
    if recipe.config.trainer_only:
        g = 0  # (a replica group sharing group 0's generators has none)
    if n and n <= g:
        raise RecipeError(f"num_processes={n} leaves no trainer rank beside num_generator_processes={g}.")
    tp, shard = recipe.config.trainer_tensor_parallel_size, recipe.config.trainer_fsdp_shard_size
    if n and (n - g) % tp:
        raise RecipeError(f"num_processes={n} leaves {n - g} trainer ranks beside num_generator_processes={g}, which "
                          f"trainer_tensor_parallel_size={tp} does not divide into groups.")
    if n and shard and ((n - g) // tp) % shard:
        raise RecipeError(f"num_processes={n} leaves {(n - g) // tp} data-parallel trainer ranks, which "
                          f"trainer_fsdp_shard_size={shard} does not divide into FSDP shard groups.")


def summary(job: dict) -> str:
    """What --check prints: the layout, the batch arithmetic, the data and the rewards."""
    recipe = job["recipe"]
    script, config = recipe.script, recipe.config
    n, g = script.num_processes, config.num_generator_processes
    trainers, tp = ((n - g) if n else None), config.trainer_tensor_parallel_size
    per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * trainers // tp if n else None
    from hfllamarl.runtime.world.mesh import describe

    shard = config.trainer_fsdp_shard_size
    layout = (f" ({describe(tp, trainers // tp if n else None, shard, config.trainer_sequence_parallel)})"
              if tp > 1 or shard else "")
    lines = [
        f"recipe OK: {n or '?'} processes = {trainers or '?'} trainer{layout} + {g} generator ranks "
        f"({config.num_generator_replicas} vLLM replica(s) of tensor-parallel {config.generator_tensor_parallel_size}, "
        f"quantization {config.generator_quantization or 'none'}); {per_step or '?'} completions per step, "
        f"{config.num_generations} per prompt; staleness <= {config.max_staleness}; algorithm {config.algorithm}"
        + _correction(config),
        f"  model:   {recipe.model.model_name_or_path}",
    ]
    data = job["train_dataset"]
    if data is not None:
        lines.append(f"  data:    {script.dataset_name} [{script.dataset_train_split}]: {len(data)} rows, columns "
                     f"{data.column_names}")
        lines.append(f"  prompt:  {_short(data[0]['prompt'])}")
    if job["eval_dataset"] is not None:
        lines.append(f"  eval:    [{script.dataset_test_split}]: {len(job['eval_dataset'])} rows")
    names = [r if isinstance(r, str) else f"{r.__module__}:{r.__name__}" for r in job["rewards"]]
    lines.append(f"  rewards: {', '.join(names) or '(from the environment)'}")
    if script.environments or script.tools:
        lines.append(f"  agents:  environments {script.environments or '-'}; tools {script.tools or '-'}")
    lines.append(f"  output:  {config.output_dir}")
    if job.get("launch"):
        lines.append(f"  launch:  accelerate launch {' '.join(job['launch'])} -m hfllamarl.cli train ...")
    return "\n".join(lines)


def _correction(config) -> str:
    """", off-policy correction X" (what off_policy_correction="auto" resolved to, for this staleness and loss), or
    "" for an algorithm that takes none."""
    correction = config.algorithm_options.get("off_policy_correction")
    return "" if correction is None else f", off-policy correction {correction}"


def _short(value, width: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def train(job: dict) -> None:
    """Build `AsyncAIPOTrainer` from the checked job and train; the model is saved to output_dir at the end."""
    from trl import get_peft_config

    from hfllamarl import AsyncAIPOTrainer

    recipe = job["recipe"]
    config, model = recipe.config, recipe.model
    # As TRL's script, ModelConfig's loading options reach from_pretrained; only those set away from their default,
    # so that a plain recipe keeps the sharded loader (any from_pretrained keyword makes each rank load it whole).
    init = dict(config.model_init_kwargs or {})
    if model.model_revision not in (None, "main"):
        init.setdefault("revision", model.model_revision)
    if model.attn_implementation:
        init.setdefault("attn_implementation", model.attn_implementation)
    if model.dtype not in (None, "float32"):
        init.setdefault("dtype", model.dtype)
    config.model_init_kwargs = init or None
    trainer = AsyncAIPOTrainer(model=model.model_name_or_path, reward_funcs=job["rewards"] or None, args=config,
                               train_dataset=job["train_dataset"], eval_dataset=job["eval_dataset"],
                               peft_config=get_peft_config(model), tools=job["tools"] or None,
                               environment_factory=job["environments"])
    resume = config.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "true" else resume)
    trainer.save_model(config.output_dir)
    if trainer.state is not None and trainer.state.is_world_process_zero:
        print(f"hfllamarl train: done; model saved to {config.output_dir}")
