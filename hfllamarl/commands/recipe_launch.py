"""A recipe's launch keys, as `trl grpo --config` reads them: `num_processes`, `accelerate_config`, `main_process_port`,
`max_restarts`.

`trl grpo --config recipe.yaml` hands the keys its script does not know to `accelerate launch`, and
`accelerate_config` names one of TRL's accelerate configs (`fsdp2`, `multi_gpu`, `zero2`, ...) or a file. So
does `hfllamarl train` when it was started without a launcher: a recipe that asks for more than one process, or
names an accelerate config, is started again under `accelerate launch` with them (`launch_command`), and each process
reads the same recipe. Under a launcher (WORLD_SIZE set) the launcher has already chosen and the keys are left alone.

A config the trainer cannot honour is refused before anything starts (`check_config`): DeepSpeed (the trainer ranks
shard the policy with FSDP2, which shards parameters, gradients and optimizer state as ZeRO-3 does), FSDP version 1,
parameters offloaded to the CPU, accelerate's activation checkpointing (the recipe's `gradient_checkpointing` is the
trainer's), fp16 / fp8 mixed precision (the recipe's `bf16` decides); and TRL's `single_gpu` with more than one
process.
"""

from __future__ import annotations

import os
import sys

ENV_OWN_LAUNCH = "HFLLAMARL_RECIPE_LAUNCH"  # set in the processes `hfllamarl train` starts itself

#: TRL's own accelerate configs (`trl/accelerate_configs/<name>.yaml`), by the names `trl grpo` takes.
TRL_CONFIGS = ("fsdp1", "fsdp2", "multi_gpu", "single_gpu", "zero1", "zero2", "zero3")


def config_file(name: str) -> str:
    """The accelerate config file `accelerate_config: name` means: one of TRL's by its name, else a path."""
    from .recipe import RecipeError

    if os.path.isfile(name):
        return name
    if name in TRL_CONFIGS:
        from importlib import resources

        path = resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")
        if path.is_file():
            return str(path)
    raise RecipeError(f"accelerate_config {name!r}: neither a file nor one of TRL's accelerate configs "
                      f"({', '.join(TRL_CONFIGS)}).")


def check_config(path: str, name: str) -> dict:
    """Read an accelerate config file and refuse what the trainer cannot honour; returns its mapping."""
    import yaml

    from .recipe import RecipeError

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"accelerate_config {name!r}: {path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"accelerate_config {name!r}: {path} is not a YAML mapping.")
    kind = str(data.get("distributed_type", "NO")).upper()
    fsdp = data.get("fsdp_config") or {}
    why = None
    if kind == "DEEPSPEED":
        why = ("it asks for DeepSpeed; the trainer ranks shard the policy with torch FSDP2, which shards parameters, "
               "gradients and optimizer state as ZeRO-3 does. Use accelerate_config: fsdp2 or multi_gpu, or leave it "
               "out")
    elif kind == "FSDP" and str(fsdp.get("fsdp_version", 1)) != "2":
        why = "it asks for FSDP version 1; the trainer trains with FSDP2. Use accelerate_config: fsdp2"
    elif kind == "FSDP" and _true(fsdp.get("fsdp_offload_params")):
        why = "it offloads parameters to the CPU (fsdp_offload_params), which the trainer does not do"
    elif kind == "FSDP" and _true(fsdp.get("fsdp_activation_checkpointing")):
        why = ("it asks accelerate for activation checkpointing; the trainer's is the recipe's "
               "gradient_checkpointing: true")
    elif str(data.get("mixed_precision", "no")).lower() in ("fp16", "fp8"):
        why = (f"mixed_precision {data['mixed_precision']}: the trainer computes in bf16 or fp32, as the recipe's bf16 "
               "says")
    if why:
        raise RecipeError(f"accelerate_config {name!r} ({path}) cannot be honoured: {why}.")
    return data


def _true(value) -> bool:
    return str(value).lower() in ("true", "1", "yes")


def resolve(script, launched: bool) -> list[str] | None:
    """The `accelerate launch` arguments this recipe asks for (None: train in this process). Fills
    `script.num_processes` from the config file when the recipe leaves it unset, so that the layout is checked
    against the processes that will start. Under a launcher the launcher has chosen: the launch keys are not read,
    and a warning says so unless it was `hfllamarl train`'s own launch."""
    from .recipe import RecipeError

    if script.max_restarts < 0:
        raise RecipeError(f"max_restarts={script.max_restarts}: give a number of restarts >= 0.")
    keys = [k for k in ("accelerate_config", "main_process_port", "max_restarts") if getattr(script, k)]
    if launched:
        if keys and os.environ.get(ENV_OWN_LAUNCH) != "1" and os.environ.get("RANK", "0") == "0":
            print(f"hfllamarl train: warning: {', '.join(keys)} are read when hfllamarl train starts its own processes; "
                  "under this launcher, the launcher's own flags decide.", file=sys.stderr)
        return None
    path = None
    if script.accelerate_config:
        path = config_file(script.accelerate_config)
        data = check_config(path, script.accelerate_config)
        if str(data.get("distributed_type", "NO")).upper() == "NO":  # (accelerate starts one process for it)
            if script.num_processes > 1:
                raise RecipeError(f"accelerate_config {script.accelerate_config!r} starts one process "
                                  f"(distributed_type NO) but num_processes is {script.num_processes}: use multi_gpu "
                                  "or fsdp2 for several.")
        elif not script.num_processes and isinstance(data.get("num_processes"), int):
            script.num_processes = data["num_processes"]
    if script.num_processes <= 1:  # one process: the trainer and its generator children, as without a launcher
        if script.max_restarts or script.main_process_port:
            raise RecipeError("max_restarts and main_process_port are options of a launch of several processes: set "
                              "num_processes >= 2 (or start the job under a launcher with its own flags).")
        return None
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and script.num_processes > gpus:
        raise RecipeError(f"num_processes={script.num_processes} but this machine has {gpus} GPUs: a launch over "
                          "several machines is the launcher's (accelerate launch --num_machines N --machine_rank "
                          "R --main_process_ip IP ... -m hfllamarl.cli train --config ..., on each machine).")
    args = (["--config_file", path] if path else ["--multi_gpu"]) + ["--num_processes", str(script.num_processes)]
    if script.main_process_port:
        args += ["--main_process_port", str(script.main_process_port)]
    if script.max_restarts:
        args += ["--max_restarts", str(script.max_restarts)]
    return args


def launch_command(launch_args: list[str], argv: list[str]) -> list[str]:
    """The command that starts this recipe under `accelerate launch`: every process runs `hfllamarl train` with
    the same arguments."""
    return [sys.executable, "-m", "accelerate.commands.launch", *launch_args, "-m", "hfllamarl.cli", "train", *argv]
