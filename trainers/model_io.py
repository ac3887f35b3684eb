"""Where the policy comes from: a local directory, a hub id, or a model object; and how it is loaded."""

from __future__ import annotations

import os

from hfllamarl.runtime.loading import hub_snapshot, looks_like_hub_id


def resolve_model(model, args):
    """Return (local model directory, model object or None, model config).

    A string is a local directory or a hub id (resolved to its local snapshot); a model object
    is used as is by the trainer and saved to a directory for the generator when it needs one.
    """
    from transformers import AutoConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        path = getattr(model.config, "_name_or_path", "") or ""
        return path, model, model.config
    if not isinstance(model, (str, os.PathLike)):
        hint = (" For LoRA, pass the base model and peft_config=LoraConfig(...): the trainer applies the adapters "
                "itself." if type(model).__name__.startswith("Peft") else "")
        raise TypeError(f"model must be a path, a hub id or a PreTrainedModel, got {type(model).__name__}.{hint}")
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
            ) from exc
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"Model directory {path!r} has no config.json: is it a model saved with save_pretrained()?")
    return path, None, AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)


def save_for_generator(model, tokenizer, directory: str) -> str:
    """Save a model object and its tokenizer where a generator process can load them; return the directory."""
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_policy(path: str, args, config):
    """The policy of the model at `path` for a trainer rank: built on the meta device, to be sharded and then
    filled rank by rank (`hfllamarl.runtime.loading`), when this loader can read the checkpoint; otherwise loaded whole
    with `from_pretrained` (said in the log)."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.loading import build_empty, readable

    kwargs = dict(args.model_init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", torch.float32))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    attn = kwargs.pop("attn_implementation", None)
    remote = bool(kwargs.pop("trust_remote_code", args.trust_remote_code))
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
