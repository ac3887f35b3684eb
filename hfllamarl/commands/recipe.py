"""Recipes for `hfllamarl train`: a YAML file and/or command-line flags, read and checked before any process starts.

A recipe holds the fields of four dataclasses, as TRL's `trl grpo --config` reads them with `TrlParser`:
`RecipeArguments` (below: the data set, the prompt, the rewards, environments and tools, a builder),
`AsyncAIPOConfig` (the training run), TRL's `ModelConfig` (`model_name_or_path`, `dtype`, LoRA) and TRL's
`DatasetMixtureConfig` (`datasets:`, a mixture of data sets loaded by TRL's own `get_dataset`).
A command-line flag overrides the YAML. Unlike `TrlParser` alone, every YAML value is converted and checked
against its field's type and choices (`learning_rate: 1e-3` is a string to YAML; here it is the float it means),
and an unknown key or flag is named with the closest field.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the field and what to do."""


@dataclass
class RecipeArguments:
    """The fields of a recipe beyond `AsyncAIPOConfig` and TRL's `ModelConfig`."""

    dataset_name: str | None = field(default=None, metadata={
        "help": "The data set: a local file (.jsonl, .json, .parquet, .csv), a directory saved with "
                "`Dataset.save_to_disk`, a local directory of data files, or a Hub id (as TRL's ScriptArguments)."})
    dataset_config: str | None = field(default=None, metadata={
        "help": "The data set's configuration name (`name` of `datasets.load_dataset`), e.g. `main` for gsm8k."})
    dataset_train_split: str = field(default="train", metadata={"help": "The split to train on."})
    dataset_test_split: str = field(default="test", metadata={
        "help": "The split to evaluate on; read only when eval_strategy is not 'no' (as TRL's script)."})
    rename_columns: str | None = field(default=None, metadata={
        "help": "Columns to rename before anything else reads them, {old: new} (a YAML mapping, or JSON on the "
                "command line): e.g. {solution: answer} for MATH rows scored by math_sympy."})
    prompt_column: str = field(default="prompt", metadata={
        "help": "The column holding the prompt: text, or chat messages [{role, content}, ...]."})
    prompt_template: str | None = field(default=None, metadata={
        "help": "Build the prompt from the row instead: each {column} is replaced by that column's value; other "
                "braces stay as they are (`\\boxed{}` needs no escaping)."})
    chat: bool = field(default=False, metadata={
        "help": "Send a text prompt as one user message (the tokenizer's chat template renders it)."})
    system_prompt: str | None = field(default=None, metadata={
        "help": "With chat: a system message put before the user message."})
    reward_funcs: list[str] = field(default_factory=list, metadata={
        "help": "Reward functions: installed reward plugin names (`hfllamarl plugins list`), dotted paths "
                "`pkg.module:function` (or TRL's `pkg.module.function`), or reward models (a local directory "
                "or a Hub id)."})
    environments: list[str] = field(default_factory=list, metadata={
        "help": "Environments (the trainer's environment_factory): installed environment plugin names or dotted "
                "paths to a class. Several: each row names its own in an `environment` column."})
    tools: list[str] = field(default_factory=list, metadata={
        "help": "Tool functions the model may call, as dotted paths `pkg.module:function`."})
    prepare: str | None = field(default=None, metadata={
        "help": "A builder run before the model and data set are loaded, as a dotted path `pkg.module:function`, "
                "called with prepare_kwargs in every process of the job, one at a time (a file lock): it must "
                "return at once when its files exist. It may return {field: value} to fill recipe fields left unset "
                "(e.g. model_name_or_path, dataset_name)."})
    prepare_kwargs: str | None = field(default=None, metadata={
        "help": "Keyword arguments of `prepare` (a YAML mapping, or JSON on the command line)."})
    num_processes: int = field(default=0, metadata={
        "help": "Processes over all nodes. Started without a launcher, `hfllamarl train` starts this many under "
                "`accelerate launch` (as `trl grpo` does); under a launcher, the check verifies the layout against "
                "it."})
    accelerate_config: str | None = field(default=None, metadata={
        "help": "As `trl grpo`: an accelerate config for the launch, one of TRL's (fsdp2, multi_gpu, single_gpu; "
                "zero1-3 and fsdp1 are refused: the trainer shards with FSDP2) or a file. Read when `hfllamarl "
                "train` is started without a launcher."})
    main_process_port: int = field(default=0, metadata={
        "help": "The rendezvous port of the launch `hfllamarl train` starts (accelerate's --main_process_port)."})
    max_restarts: int = field(default=0, metadata={
        "help": "The launch `hfllamarl train` starts restarts a failed job this many times (accelerate's "
                "--max_restarts); each restart resumes from the newest checkpoint by itself (set save_steps)."})
    check: bool = field(default=False, metadata={
        "help": "Validate the recipe (fields, data set columns, rewards) and exit without training."})


@dataclass
class Recipe:
    """A parsed recipe: the three dataclasses, and where it came from."""

    script: RecipeArguments
    config: Any  # AsyncAIPOConfig
    model: Any  # trl.ModelConfig
    path: str | None = None
    mixture: Any = None  # trl.DatasetMixtureConfig


def _parser():
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from hfllamarl import AsyncAIPOConfig

    class Parser(TrlParser):
        def error(self, message):  # argparse would print usage and exit: say it as a recipe error instead
            raise RecipeError(message)

    return Parser((RecipeArguments, AsyncAIPOConfig, ModelConfig, DatasetMixtureConfig), prog="hfllamarl train")


def parse_recipe(argv: list[str]) -> Recipe:
    """Read `--config FILE` (optional) and the flags into a `Recipe`; raise `RecipeError` naming what is wrong."""
    argv = list(argv)
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            del argv[i:i + (1 if "=" in arg else 2)]
            if not path:
                raise RecipeError("--config needs the path of a recipe YAML file.")
            break
    parser = _parser()
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)
    if any(a in ("-h", "--help") for a in argv):
        print(short_help())
        raise SystemExit(0)
    if path is not None:
        parser.set_defaults_with_config(**_read_yaml(path, parser))
    try:
        *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except RecipeError:
        raise
    except (ValueError, TypeError) as exc:  # AsyncAIPOConfig's and ModelConfig's own checks
        raise RecipeError(f"bad value: {exc}") from None
    flags = [a for a in unknown if a.startswith("--")]
    if unknown:
        raise RecipeError("; ".join(_unknown(a.lstrip("-").split("=")[0], parser, "command-line flag")
                                    for a in flags) or f"unexpected arguments {unknown}")
    script, config, model, mixture = parsed
    script.rename_columns = _mapping(script.rename_columns, "rename_columns")
    script.prepare_kwargs = _mapping(script.prepare_kwargs, "prepare_kwargs")
    if mixture.streaming:
        raise RecipeError("streaming: true: prompts are picked by index from the data set (every rank and a resume "
                          "must agree on them), which a streamed data set cannot give; load it whole (streaming: "
                          "false) or save the part you train on to a file.")
    return Recipe(script, config, model, path, mixture)


def short_help() -> str:
    """`hfllamarl train --help`: how to run a recipe and the recipe's own fields; the hundreds of training fields
    are behind --help-all."""
    lines = ["usage: hfllamarl train --config recipe.yaml [--field value ...] [--check]",
             "",
             "Train from a recipe: a YAML file of field: value (TRL's `trl grpo --config` format), each field also a",
             "flag that overrides the file (`--learning_rate 1e-6`). --check validates the recipe (fields, data set,",
             "rewards, layout) and exits without training.",
             "",
             "The recipe's own fields:"]
    for f in dataclasses.fields(RecipeArguments):
        text = f.metadata.get("help", "")
        lines.append(f"  --{f.name}")
        lines += [f"      {part}" for part in _wrap(text, 100)]
    lines += ["",
              "Also: every AsyncAIPOConfig field (TRL's GRPOConfig fields and the asynchronous runtime's: output_dir,",
              "learning_rate, num_generator_processes, max_staleness, ...), TRL's ModelConfig (model_name_or_path,",
              "use_peft, lora_r, ...) and TRL's DatasetMixtureConfig (datasets:). `hfllamarl train --help-all` lists",
              "every flag with its help; the docs' Configuration and TRL fields pages list them by topic."]
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def _read_yaml(path: str, parser) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise RecipeError(f"--config {path}: no such file.")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a YAML mapping of field: value, not a {type(data).__name__}.")
    env = data.pop("env", {})  # as TrlParser: environment variables the recipe sets
    if not isinstance(env, dict):
        raise RecipeError(f"{path}: `env` must be a mapping of NAME: value.")
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    actions = {a.dest: a for a in parser._actions}
    errors = [_unknown(key, parser, f"{path}: key") for key in data if key not in actions]
    out = {}
    for key, value in data.items():
        if key in actions:
            try:
                out[key] = _coerce(actions[key], value)
            except (ValueError, TypeError) as exc:
                errors.append(f"{path}: {key}: {exc}")
    if errors:
        raise RecipeError("\n".join(errors))
    return out


def _unknown(key: str, parser, where: str) -> str:
    from hfllamarl.registry import did_you_mean

    fields = sorted({a.dest for a in parser._actions if a.dest != "help"})
    return (f"{where} {key!r} is not a recipe field.{did_you_mean(key, fields, n=3)} The fields are those of "
            "AsyncAIPOConfig, TRL's ModelConfig and DatasetMixtureConfig, and the recipe's own "
            "(`hfllamarl train --help-all` lists them all).")


def _coerce(action, value):
    """`value` (from YAML) as the command line would have made it: the field's type, checked against its choices."""
    if action.nargs in ("+", "*") and value is not None:
        return [_coerce_one(action, v) for v in (value if isinstance(value, list) else [value])]
    return _coerce_one(action, value)


def _coerce_one(action, value):
    kind = action.type
    if value is None or kind is None or isinstance(value, (dict, list)):
        return value  # a None default, a plain string field, or a mapping a `dict | str` field takes as it is
    if kind in (int, float) and isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected a whole number, got {value!r}")
    try:
        converted = kind(value) if isinstance(value, str) or kind in (int, float) else value
    except (ValueError, TypeError, KeyError):
        name = getattr(kind, "__name__", "its type")
        raise ValueError(f"{value!r} is not a valid {name.replace('string_to_bool', 'bool')}") from None
    if action.choices is not None and converted not in action.choices and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {sorted(map(str, action.choices))}")
    return converted


def _mapping(value, name: str) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    try:
        data = json.loads(value)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise RecipeError(f"{name} must be a mapping: in YAML `{name}: {{key: value}}`, on the command line a JSON "
                          f"object (--{name} '{{\"key\": \"value\"}}'); got {value!r}.")
    return data


def import_object(path: str, what: str):
    """The object `pkg.module:name` (or TRL's `pkg.module.name`) names; the working directory is importable, as TRL's
    script makes it."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise RecipeError(f"{what} {path!r} is not a dotted path: write it as `pkg.module:name`.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise RecipeError(f"{what} {path!r}: module {module!r} could not be imported ({exc}).") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise RecipeError(f"{what} {path!r}: module {module!r} has no {part!r}.")
        obj = getattr(obj, part)
    return obj


def is_dotted(name: str) -> bool:
    """A `pkg.module:name` or `pkg.module.name` path, not a file or a Hub id."""
    return (":" in name or "." in name) and "/" not in name and not os.path.exists(name)


def run_prepare(recipe: Recipe) -> None:
    """Run the recipe's builder (once per process, one process at a time) and fill the fields it returns."""
    script = recipe.script
    if not script.prepare:
        return
    import fcntl

    func = import_object(script.prepare, "prepare")
    if not callable(func):
        raise RecipeError(f"prepare {script.prepare!r} is not a function.")
    os.makedirs(recipe.config.output_dir, exist_ok=True)
    # Every process of a launcher runs the recipe: the lock makes the first one build and the others find it built.
    with open(os.path.join(recipe.config.output_dir, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            result = func(**(script.prepare_kwargs or {}))
        except TypeError as exc:
            raise RecipeError(f"prepare {script.prepare!r} with prepare_kwargs {script.prepare_kwargs}: {exc}") from None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if result is None:
        return
    if not isinstance(result, dict):
        raise RecipeError(f"prepare {script.prepare!r} returned a {type(result).__name__}; it returns None or a "
                          "mapping {recipe field: value}.")
    for key, value in result.items():
        owner = next((o for o in (script, recipe.model) if key in {f.name for f in dataclasses.fields(o)}), None)
        if owner is None:
            raise RecipeError(f"prepare {script.prepare!r} returned {key!r}, which is not a field of RecipeArguments "
                              "or ModelConfig.")
        if getattr(owner, key) in (None, "", []):  # what the recipe sets itself wins
            setattr(owner, key, value)


# ------------------------------------------------------------------------------------------------ data set
DATA_FILES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_splits(script: RecipeArguments, splits: list[str], mixture=None) -> dict:
    """The requested splits of the recipe's data set, as `datasets.Dataset`s, by split name: TRL's `datasets:`
    mixture when the recipe has one (as `trl grpo`: it wins over dataset_name, its splits are "train" and, with
    test_split_size, "test"), else dataset_name."""
    import datasets

    datasets.disable_progress_bars()
    if mixture is not None and mixture.datasets:
        from trl import get_dataset

        if script.dataset_name:
            import logging

            logging.getLogger("hfllamarl").warning("Both `datasets` and `dataset_name` are given: the `datasets` "
                                                   "mixture is loaded and `dataset_name` is not read (as trl grpo).")
        try:
            loaded = get_dataset(mixture)
        except Exception as exc:  # noqa: BLE001 - a missing file, an unknown id, offline: the recipe's to fix
            raise RecipeError(f"datasets (the mixture) could not be loaded: {type(exc).__name__}: {exc}") from None
        return _pick(loaded, splits, script, "the `datasets` mixture")
    name = script.dataset_name
    if not name:
        raise RecipeError("dataset_name is not set: give a local file (.jsonl, .json, .parquet, .csv), a saved "
                          "`datasets` directory or a Hub id, or TRL's `datasets:` mixture (or a `prepare` builder "
                          "that returns one).")
    ext = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if ext not in DATA_FILES:
            raise RecipeError(f"dataset_name {name!r}: a data file must end in one of {sorted(DATA_FILES)}.")
        loaded = datasets.load_dataset(DATA_FILES[ext], data_files=name)  # one split, "train"
    elif os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in
                                     ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({"train": loaded})
    elif ext in DATA_FILES or name.startswith((".", "/", "~")):
        raise RecipeError(f"dataset_name {name!r}: no such file or directory (relative paths start from "
                          f"{os.getcwd()}).")
    else:  # a local directory of data files, or a Hub id
        try:
            loaded = datasets.load_dataset(name, name=script.dataset_config)
        except Exception as exc:  # noqa: BLE001 - offline, unknown id, missing config: all are the recipe's to fix
            raise RecipeError(f"dataset_name {name!r} (dataset_config {script.dataset_config!r}) could not be "
                              f"loaded: {type(exc).__name__}: {exc}") from None
    return _pick(loaded, splits, script, repr(name))


def _pick(loaded, splits: list[str], script: RecipeArguments, what: str) -> dict:
    missing = [s for s in splits if s not in loaded]
    if missing:
        field_of = {script.dataset_train_split: "dataset_train_split", script.dataset_test_split: "dataset_test_split"}
        raise RecipeError("; ".join(f"{field_of.get(s, 'split')}={s!r}: {what} has no such split" for s in missing)
                          + f" (its splits: {sorted(loaded)}).")
    return {s: loaded[s] for s in splits}


def template_columns(template: str) -> list[str]:
    """The {column} names a prompt template reads."""
    import re

    return re.findall(r"\{(\w+)\}", template)


def to_prompts(dataset, script: RecipeArguments):
    """The data set with its columns renamed and a `prompt` column built as the recipe says; the other columns stay
    (they reach the reward functions). A missing column is a `RecipeError` naming it and the columns there are."""
    import re

    if script.rename_columns:
        absent = sorted(set(script.rename_columns) - set(dataset.column_names))
        if absent:
            raise RecipeError(f"rename_columns names {absent}, not columns of the data set (its columns: "
                              f"{dataset.column_names}).")
        taken = sorted(set(script.rename_columns.values()) & (set(dataset.column_names) - set(script.rename_columns)))
        if taken:
            raise RecipeError(f"rename_columns would make {taken} twice: the data set already has such a column "
                              f"(its columns: {dataset.column_names}); rename or drop that one first.")
        dataset = dataset.rename_columns(script.rename_columns)
    needed = template_columns(script.prompt_template) if script.prompt_template else [script.prompt_column]
    absent = [c for c in needed if c not in dataset.column_names]
    if absent:
        where = "prompt_template reads" if script.prompt_template else "prompt_column is"
        raise RecipeError(f"{where} {absent}, not a column of the data set {script.dataset_name!r} (its columns: "
                          f"{dataset.column_names}); set prompt_column or prompt_template to one of them, or "
                          "rename_columns.")
    if script.system_prompt and not script.chat:
        raise RecipeError("system_prompt is set but chat is false: a system message needs chat prompts (chat: true).")
    if not script.prompt_template and not script.chat and script.prompt_column == "prompt":
        return dataset
    template = script.prompt_template

    def build(row):
        text = re.sub(r"\{(\w+)\}", lambda m: str(row[m.group(1)]), template) if template else row[script.prompt_column]
        if script.chat and isinstance(text, str):
            text = ([{"role": "system", "content": script.system_prompt}] if script.system_prompt else []) + \
                   [{"role": "user", "content": text}]
        return {"prompt": text}

    return dataset.map(build)


# ------------------------------------------------------------------------------------------------ rewards, agents
#: The reward names `trl grpo` takes without a path (its script's registry), with the arguments it gives them.
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")


def trl_reward(name: str):
    """The reward function `trl grpo` means by `name` (TRL's `trl.rewards`, as that script builds it)."""
    import trl.rewards

    if name == "get_soft_overlong_punishment":  # (the values trl grpo uses)
        return trl.rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return getattr(trl.rewards, name)


def resolve_rewards(names: list[str]) -> list:
    """Each reward name as the trainer takes it: a plugin name or a reward model stays a string (the trainer loads
    it; the plugin is imported here so that a broken one fails now), a dotted path becomes its function."""
    from hfllamarl.registry import PluginError, did_you_mean, installed, load_plugin
    from hfllamarl.runtime.weights.loading import looks_like_hub_id

    plugins = installed("rewards")
    out = []
    for name in names:
        if name in plugins:
            try:
                load_plugin("rewards", name)
            except PluginError as exc:
                raise RecipeError(f"reward_funcs: {exc}") from None
            out.append(name)
        elif name in TRL_REWARDS:
            out.append(trl_reward(name))
        elif is_dotted(name):
            func = import_object(name, "reward_funcs entry")
            if not callable(func):
                raise RecipeError(f"reward_funcs entry {name!r} is a {type(func).__name__}, not a function.")
            out.append(func)
        elif os.path.isdir(name) or looks_like_hub_id(name):
            out.append(name)  # a reward model: its directory, or its Hub id
        else:
            raise RecipeError(f"reward_funcs: no reward plugin named {name!r}.{did_you_mean(name, plugins)} Installed "
                              f"reward plugins: {', '.join(sorted(plugins)) or '(none)'}; TRL's, as `trl grpo` names "
                              f"them: {', '.join(TRL_REWARDS)}. Or give a dotted path `pkg.module:function`, a reward "
                              "model's directory or its Hub id.")
    return out


def resolve_environments(names: list[str]):
    """The trainer's environment_factory: None, one factory, or {name: factory} for several."""
    from hfllamarl.registry import installed

    if not names:
        return None
    plugins = installed("environments")
    factories = {}
    for name in names:
        if name in plugins:
            factories[name] = name  # the trainer loads the plugin
        elif is_dotted(name):
            factories[name] = import_object(name, "environments entry")
        else:
            raise RecipeError(f"environments: no environment plugin named {name!r}. Installed environment plugins: "
                              f"{', '.join(sorted(plugins)) or '(none)'}. Or give a dotted path `pkg.module:Class`.")
    return next(iter(factories.values())) if len(factories) == 1 else factories


def resolve_tools(names: list[str]) -> list:
    tools = []
    for name in names:
        func = import_object(name, "tools entry")
        if not callable(func):
            raise RecipeError(f"tools entry {name!r} is a {type(func).__name__}, not a function.")
        tools.append(func)
    return tools


def dry_run_rewards(rewards: list, dataset) -> None:
    """Call each reward function once, on row 0 with an empty completion, so that a column it needs and the data set
    lacks is named now rather than at the first training step. Reward models are not called."""
    import asyncio

    from hfllamarl.runtime.data.prompts import is_conversational

    row = dataset[0]
    columns = {k: [v] for k, v in row.items() if k != "prompt"}
    empty = [{"role": "assistant", "content": ""}] if is_conversational(row["prompt"]) else ""
    for func in rewards:
        if isinstance(func, str):
            from hfllamarl.registry import installed, load_plugin

            if func not in installed("rewards"):
                continue  # a reward model
            func = load_plugin("rewards", func)
        name = getattr(func, "__name__", type(func).__name__)
        try:
            out = func(prompts=[row["prompt"]], completions=[empty], completion_ids=[[]], trainer_state=None,
                       log_metric=lambda *a, **k: None, log_extra=lambda *a, **k: None, **columns)
            if asyncio.iscoroutine(out):
                out = asyncio.run(out)
        except Exception as exc:  # noqa: BLE001 - whatever it is, training would meet it at step 1
            raise RecipeError(f"reward function {name!r} fails on row 0 of the data set (columns "
                              f"{dataset.column_names}) with an empty completion: {type(exc).__name__}: {exc}") from None
        if not isinstance(out, (list, tuple)) or len(out) != 1:
            raise RecipeError(f"reward function {name!r} returned {out!r} for one completion; it must return a list "
                              "of one float (or None) per completion.")
