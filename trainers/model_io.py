"""Where the policy comes from: a local directory, a hub id, or a model object; and how it is loaded."""

from __future__ import annotations

import os

from hfllamarl.runtime.weights.loading import hub_snapshot, looks_like_hub_id


def resolve_model(model, args):
    """Return (local model directory, model object or None, model config).

    A string is a local directory or a hub id (resolved to its local snapshot); a model object (a PreTrainedModel,
    or a peft PeftModel whose adapters are then trained as given) is used as is by the trainer and saved to a
    directory for the generator when it needs one (merged, see `save_for_generator`).
    """
    from transformers import AutoConfig, PreTrainedModel

    from hfllamarl.runtime.weights.lora import is_peft

    plain = model.get_base_model() if is_peft(model) else model
    if isinstance(plain, PreTrainedModel):
        path = getattr(plain.config, "_name_or_path", "") or ""
        return path, model, plain.config
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path, a hub id, a PreTrainedModel or a peft PeftModel of one, got "
                        f"{type(model).__name__}.")
    path = os.fspath(model)
    if not os.path.isdir(path):
        if not looks_like_hub_id(path):
            raise FileNotFoundError(
                f"Model {path!r} does not exist: give the directory of a model saved with save_pretrained() "
                "(it holds config.json and the weights), or a Hugging Face Hub id."
            )
        try:
            path = hub_snapshot(path, (args.model_init_kwargs or {}).get("revision"))
        except Exception as exc:
            raise FileNotFoundError(
                f"Model {model!r} is not a local directory and could not be fetched from the Hugging Face Hub "
                f"({type(exc).__name__}: {exc}). Download it first and pass its directory."
            ) from None  # (the message holds the cause: the hub client's chained traceback would bury it)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"Model directory {path!r} has no config.json: is it a model saved with save_pretrained()?")
    return path, None, AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)


def save_for_generator(model, tokenizer, directory: str) -> str:
    """Save a model object and its tokenizer where a generator process can load them; return the directory.

    A model carrying LoRA adapters (a PeftModel, or a model `get_peft_model` wrapped in place) is saved with its
    adapters merged, under the model's own names: vLLM loads plain weights, never peft's `base_layer`/`lora_*`."""
    from hfllamarl.runtime.weights.lora import has_adapters, is_peft, merged_state_dict

    os.makedirs(directory, exist_ok=True)
    if has_adapters(model):
        plain = model.get_base_model() if is_peft(model) else model
        plain.save_pretrained(directory, state_dict=merged_state_dict(model))
    else:
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_policy(path: str, args, config, trainer_ranks: int = 2):
    """The policy of the model at `path` for a trainer rank. With several trainer ranks: built on the meta device, to
    be sharded and then filled rank by rank (`hfllamarl.runtime.weights.loading`), when this loader can read the checkpoint;
    otherwise loaded whole with `from_pretrained` (said in the log). With one trainer rank, whose shard is the whole
    model anyway: loaded with `from_pretrained` now, as TRL does, so that a script can read `trainer.model`'s
    weights before `train()`."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.weights.loading import build_empty, readable

    kwargs = dict(args.model_init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", torch.float32))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    attn = kwargs.pop("attn_implementation", None)
    remote = bool(kwargs.pop("trust_remote_code", args.trust_remote_code))
    if trainer_ranks > 1:
        if not kwargs and dtype != "auto":  # nothing from_pretrained would do that the sharded loader does not
            model = build_empty(config, dtype, attn, remote)
            unread = readable(model, path)
            if not unread:
                return model
            reason = f"its weights are not all readable by name ({unread[:3]})"
        else:
            reason = f"model_init_kwargs {sorted(kwargs) or ['dtype=auto']} need from_pretrained"
        logging.getLogger(__name__).warning(
            "Loading %s whole on every trainer rank (%s); sharded loading reads only each rank's rows.", path, reason)
    full = dict(args.model_init_kwargs or {})
    full.setdefault("dtype", torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, **full)


def is_meta(model) -> bool:
    """Whether `model` was built on the meta device (its weights are loaded after sharding)."""
    return any(p.is_meta for p in model.parameters())
