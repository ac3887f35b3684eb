"""Sequence parallelism inside a trainer tensor-parallel group (`trainer_sequence_parallel`), Megatron's layout.

Under tensor parallelism alone every rank of a group holds the whole residual stream and runs the norms on every
token: those activations are not split. With sequence parallelism the stream between the blocks is split by
sequence position, each rank holding 1/t of the tokens:

- the first decoder layer takes this rank's chunk of the embeddings' output (`_Scatter`: its backward gathers the
  chunks' gradients whole again);
- the attention and MLP blocks gather their input whole (`block_input`: an all-gather to a replicated `DTensor`
  the column-split projections read; its backward is one reduce-scatter of their summed input gradients), and
  their row-split o / down projections end in a reduce-scatter to this rank's chunk instead of an all-reduce
  (`tensor_parallel.layer_plan`);
- the final norm's output is gathered whole for the output layer (`_Gather`: every rank then computes the same
  loss, so the gradient reaching it is the same on every rank and its backward keeps this rank's chunk).

The norms see this rank's tokens only: their gradients are summed over the group after backward, as the q/k norms'
are (`tensor_parallel.reduce_partial_gradients`). The communication volume equals tensor parallelism's alone (an
all-reduce is a reduce-scatter plus an all-gather); what is saved is activation memory, which grows with the
sequence length. The sequence length must be a multiple of the group size: the trainer pads its batches to it.
"""

from __future__ import annotations

import torch


class SequenceParallelError(ValueError):
    """The model or the batch cannot be split by sequence as asked; the message says why."""


def _chunk(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    t, rank = dist.get_world_size(group), dist.get_rank(group)
    length = x.shape[1]
    if length % t:
        raise SequenceParallelError(
            f"trainer_sequence_parallel: a sequence of {length} positions does not split over the {t} ranks of the "
            f"tensor-parallel group; pad the batch to a multiple of {t} (the trainer does: pad_to_multiple_of).")
    return x.narrow(1, rank * (length // t), length // t)


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _Scatter(torch.autograd.Function):
    """Forward: this rank's chunk of the (replicated) sequence; backward: the chunks' gradients gathered whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _chunk(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    """Forward: the chunks gathered whole; backward (the same gradient on every rank): this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _chunk(grad, ctx.group).contiguous(), None


def _hidden(args: tuple, kwargs: dict):
    """The hidden states a decoder layer or block is called with: the first positional argument or `hidden_states`."""
    if args:
        return args[0], lambda h: ((h, *args[1:]), kwargs)
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], lambda h: (args, {**kwargs, "hidden_states": h})
    raise SequenceParallelError("trainer_sequence_parallel: a decoder block was called without its hidden states as "
                                "the first argument or `hidden_states=`; this model's layers are not supported.")


def block_input(tp_mesh):
    """A forward pre-hook for an attention or MLP block: its input (this rank's chunk) gathered whole, as a
    replicated `DTensor` (so the gradients its column-split projections return are summed by one reduce-scatter)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module, args, kwargs):
        x, rebuild = _hidden(args, kwargs)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
        return rebuild(x.redistribute(tp_mesh, [Replicate()]))

    return hook


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm the last decoder layer's output goes through before the output layer."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or getattr(model, "model", None)
    norm = getattr(base, "norm", None) or getattr(base, "final_layernorm", None)
    if not isinstance(norm, torch.nn.Module) or not any(True for _ in norm.parameters()):
        raise SequenceParallelError(
            f"trainer_sequence_parallel: cannot find the final norm of {type(model).__name__} (its base model's "
            "`norm`), where the sequence is gathered for the output layer; train it with "
            "trainer_sequence_parallel=False.")
    return norm


def blocks(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention and MLP blocks of a decoder layer (the modules holding q_proj and down_proj)."""
    found = []
    for leaf in ("q_proj", "down_proj"):
        name = next((n for n, _ in layer.named_modules() if n.rsplit(".", 1)[-1] == leaf), None)
        if name is None or "." not in name:
            raise SequenceParallelError(f"trainer_sequence_parallel: {type(layer).__name__} has no block holding a "
                                        f"{leaf}; train it with trainer_sequence_parallel=False.")
        found.append(layer.get_submodule(name.rsplit(".", 1)[0]))
    return found


def apply(model: torch.nn.Module, layers: list[torch.nn.Module], tp_mesh) -> set[str]:
    """Split the residual stream of `model` between its decoder `layers` by sequence over `tp_mesh` (after the
    layers' tensor-parallel plans: o / down must end in `Shard(1)`). Returns the names of the parameters whose
    gradients are now each rank's tokens' part (the norms)."""
    group = tp_mesh.get_group()
    norm = final_norm(model)
    for layer in layers:
        for block in blocks(layer):
            block.register_forward_pre_hook(block_input(tp_mesh), with_kwargs=True)

    def scatter(module, args, kwargs):
        x, rebuild = _hidden(args, kwargs)
        return rebuild(_Scatter.apply(x, group))

    order = {id(m): i for i, m in enumerate(model.modules())}  # (the first layer the forward runs: the first built)
    min(layers, key=lambda layer: order[id(layer)]).register_forward_pre_hook(scatter, with_kwargs=True)
    norm.register_forward_hook(lambda module, args, out: _Gather.apply(out, group))
    ids = {id(layer) for layer in layers} | {id(norm)}
    roots = tuple(n for n, m in model.named_modules() if id(m) in ids)
    return {f"{name}.{leaf}" for name, module in model.named_modules()
            if (name in roots or name.startswith(tuple(f"{r}." for r in roots))) and "norm" in name.rsplit(".", 1)[-1]
            for leaf, _ in module.named_parameters(recurse=False)}
