"""Tensor parallelism of the policy inside each trainer tensor-parallel group (torch's DTensor plans).

Megatron's layout, as torch's `parallelize_module` applies it to a decoder layer: the q/k/v and gate/up projections
are split by output rows (`ColwiseParallel`: whole attention heads, whole MLP columns), o and down by input columns
(`RowwiseParallel`: their partial outputs summed by one all-reduce). Attention then runs on this rank's heads only
(transformers reshapes by head size, not head count). A Qwen3 q/k norm acts per head and stays whole; biases follow
their rows. An untied output layer is split by vocabulary rows and its logits stay sharded (`DTensor`, `Shard(-1)`):
the log-probs are computed on the shards (`hfllamarl.runtime.training.vocab_parallel`), never gathered whole, and
the input embedding is split by vocabulary rows too (`RowwiseParallel`: each rank looks up the tokens of its rows,
one all-reduce). Tied ones stay whole on every rank of the group. Norms and the rest stay whole inside the group;
FSDP2 shards every parameter over the data-parallel ranks after.

With fewer KV heads than ranks (Llama-3 70B's 8 under TP 16, a tiny model's 1 under TP 2) k and v stay whole on
every rank and each rank keeps the KV head its query heads read (`replicate_kv`), as vLLM replicates KV heads. A
parameter kept whole but used on this rank's heads only (q/k norms; k/v then) gets from each rank the gradient of
its heads: the parts are summed over the group after backward (`reduce_partial_gradients`).

Sequence parallelism (`sequence=True`, `trainer_sequence_parallel`): between the attention and MLP blocks the
residual stream and the norms run on this rank's 1/t of the sequence (Megatron's sequence parallelism): the first
decoder layer takes its chunk of the sequence, each block's input is gathered whole (an all-gather, as a
`DTensor` the projections read, whose backward is one reduce-scatter), o and down end in a reduce-scatter instead
of an all-reduce, and the final norm's output is gathered for the output layer. The same communication volume; the
activations outside attention and the MLP (norms, residuals) are 1/t per rank. The norms' gradients are each
rank's tokens' part, summed like the q/k norms'. The padded sequence length must be a multiple of t (the trainer
pads to it).

Refused, with the reason: mixtures of experts (no expert-parallel plan), a head count or MLP width the group does
not divide, and a layer whose parameters are not the q/k/v/o and gate/up/down projections and norms the plan
knows.
"""

from __future__ import annotations

import torch

COLUMNWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


class TensorParallelError(ValueError):
    """The model cannot be split over the trainer tensor-parallel group as asked; the message says why."""


def check_model(config, tp: int) -> None:
    """Refuse, before anything is built, a model the plan cannot split over `tp` ranks (`config`: its HF config)."""
    if tp <= 1:
        return
    text = getattr(config, "get_text_config", lambda: config)()
    name = type(config).__name__
    experts = [a for a in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(text, a, None)]
    if experts:
        raise TensorParallelError(
            f"trainer_tensor_parallel_size={tp}: {name} is a mixture of experts ({experts[0]}="
            f"{getattr(text, experts[0])}); the trainer has no expert-parallel plan. Train it with FSDP2 alone "
            "(trainer_tensor_parallel_size=1).")
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    width = getattr(text, "intermediate_size", None)
    for what, value in (("attention heads", heads), ("KV heads", kv), ("MLP width (intermediate_size)", width)):
        if value is None:
            raise TensorParallelError(f"trainer_tensor_parallel_size={tp}: {name} does not say its {what}; the "
                                      "tensor-parallel plan needs it.")
        if what == "KV heads" and value < tp:
            if tp % value:
                raise TensorParallelError(
                    f"trainer_tensor_parallel_size={tp}: {name} has {value} KV heads; with fewer KV heads than ranks "
                    f"each rank keeps one whole, which needs the tensor-parallel size to be a multiple of them. "
                    f"Use a multiple of {value}, or a divisor of it.")
            continue
        if value % tp:
            raise TensorParallelError(
                f"trainer_tensor_parallel_size={tp}: {name}'s {value} {what} do not split evenly over {tp} ranks; use "
                "a tensor-parallel size that divides the attention heads, KV heads and MLP width.")


def check_trainer_tp(config, tp: int, peft_config=None, model=None) -> None:
    """`check_model`, and LoRA refused: its adapters have no tensor-parallel plan (every rank alike, at start)."""
    if tp <= 1:
        return
    check_model(config, tp)
    from hfllamarl.runtime.weights.lora import is_peft

    if peft_config is not None or (model is not None and is_peft(model)):
        raise TensorParallelError(
            f"trainer_tensor_parallel_size={tp} with LoRA: the adapters have no tensor-parallel plan. Train LoRA with "
            "FSDP2 alone (trainer_tensor_parallel_size=1); the base model is frozen, so sharding it over every "
            "trainer rank already costs each rank 1/N of it.")


def layer_plan(layer: torch.nn.Module, tp: int, sequence: bool = False) -> tuple[dict, list[str]]:
    """The `parallelize_module` plan of one decoder layer (names relative to it), and the linear layers left whole
    because the model has fewer KV heads than `tp` (`replicate_kv`). With `sequence`, o and down leave this rank's
    chunk of the sequence (a reduce-scatter)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kv_whole = _kv_heads(layer) is not None and _kv_heads(layer) < tp
    plan, whole, unknown = {}, [], []
    for name, module in layer.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("k_proj", "v_proj") and kv_whole:
            whole.append(name)
        elif leaf in COLUMNWISE:
            plan[name] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel()
        else:
            unknown.append(name)
    for name, module in layer.named_modules():  # every other parameter: a norm (whole) or one the plan cannot place
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, torch.nn.Linear) and any(True for _ in module.parameters(recurse=False)) \
                and "norm" not in leaf:
            unknown.append(name)
    if unknown or not plan:
        raise TensorParallelError(
            f"the trainer's tensor-parallel plan knows the q/k/v/o and gate/up/down projections and the norms of a "
            f"decoder layer; {type(layer).__name__} has {unknown or 'none of them'}. Train this model with "
            "trainer_tensor_parallel_size=1.")
    return plan, whole


def _attention(layer: torch.nn.Module):
    return next((m for m in layer.modules() if hasattr(m, "num_key_value_groups")), None)


def _kv_heads(layer: torch.nn.Module) -> int | None:
    attn = _attention(layer)
    cfg = getattr(attn, "config", None)
    return getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)


class _SummedBackward(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank's is the part of its own heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _partial_local(x):
    """A `DTensor` block input (sequence parallelism) as this rank's tensor, its gradient declared partial: the
    whole k/v's input gradient is this rank's heads' part, summed in the block input's reduce-scatter."""
    from torch.distributed.tensor import DTensor, Partial

    return x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x


def replicate_kv(layer: torch.nn.Module, names: list[str], tp_rank: int, tp: int, group,
                 sequence: bool = False) -> None:
    """Fewer KV heads than ranks (tp a multiple of them): every rank keeps k/v whole and uses the one KV head its
    query heads read (the output columns of that head); attention repeats it over the rank's query heads. The
    input's gradient through them is summed over the group (as a column-split layer's is; with `sequence`, in the
    block input's reduce-scatter)."""
    attn = _attention(layer)
    heads, kv = attn.config.num_attention_heads, _kv_heads(layer)
    head_dim = getattr(attn, "head_dim", None) or attn.config.hidden_size // heads
    mine = (tp_rank * heads // tp) // (heads // kv)  # the KV head of this rank's first query head
    for name in names:
        module = layer.get_submodule(name)
        if sequence:
            module.register_forward_pre_hook(lambda module, args: (_partial_local(args[0]), *args[1:]))
        else:
            module.register_forward_pre_hook(lambda module, args: (_SummedBackward.apply(args[0], group), *args[1:]))
        module.register_forward_hook(lambda module, args, out, s=mine * head_dim: out[..., s:s + head_dim])
    attn.num_key_value_groups = heads // tp  # this rank's query heads, all reading its one KV head


def partial_gradients(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters kept whole on every rank of a group but used on this rank's heads only (q/k norms, and k/v with
    fewer KV heads than ranks): each rank's gradient is its heads' part, and the parts are summed
    (`reduce_partial_gradients`)."""
    names = getattr(model, "_hfllamarl_partial_grads", ())  # (names: FSDP2 replaces the parameter objects)
    return [p for name, p in model.named_parameters() if name in names]


def reduce_partial_gradients(model: torch.nn.Module) -> None:
    """Sum the `partial_gradients` over the tensor-parallel group (after backward, before the gradient norm)."""
    import torch.distributed as dist

    params = partial_gradients(model)
    if not params:
        return
    group = model._hfllamarl_tp_group
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)


def tied_output(model: torch.nn.Module) -> bool:
    """Whether the output layer shares its matrix with the input embedding."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return head is not None and embed is not None and head.weight is embed.weight


def parallelize(model: torch.nn.Module, layers: list[torch.nn.Module], tp_mesh, sequence: bool = False) -> None:
    """Split `model`'s decoder `layers` and (untied) output layer over `tp_mesh`, in place (before FSDP2); with
    `sequence`, the residual stream and norms between the blocks too (`sequence_parallel`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    check_model(model.config, tp)
    partial, ids = set(), {id(layer) for layer in layers}
    for name, layer in [(n, m) for n, m in model.named_modules() if id(m) in ids]:
        plan, whole = layer_plan(layer, tp, sequence)
        parallelize_module(layer, tp_mesh, plan)
        if whole:
            replicate_kv(layer, whole, tp_mesh.get_local_rank(), tp, tp_mesh.get_group(), sequence)
        partial |= {f"{name}.{sub}.{leaf}" for sub, module in layer.named_modules()
                    if sub.rsplit(".", 1)[-1] in ("q_norm", "k_norm") or sub in whole
                    for leaf, _ in module.named_parameters(recurse=False)}
    if sequence:
        from hfllamarl.runtime.weights import sequence_parallel

        partial |= sequence_parallel.apply(model, layers, tp_mesh)
    model._hfllamarl_partial_grads, model._hfllamarl_tp_group = partial, tp_mesh.get_group()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not tied_output(model):
        # the logits stay vocabulary-sharded: `vocab_parallel` computes log-probs on the shards
        parallelize_module(head, tp_mesh, ColwiseParallel(use_local_output=False))
        # and the input embedding is split by vocabulary too (each rank looks up its rows; one all-reduce)
        parallelize_module(model.get_input_embeddings(), tp_mesh, RowwiseParallel(input_layouts=Replicate()))
