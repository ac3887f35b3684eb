"""The non-finite guard: NaN or inf in pi, mu, advantages, the loss or the gradients stops the step
before the optimizer touches the weights, with an error that names the tensor, the step, the rank,
and the first bad token of the first bad sample.

Every trainer rank reaches the same checkpoints in the same order (`agree`): a problem found on one
rank (its own micro-batch) stops all of them at once, before the backward pass whose collectives
would otherwise wait on it, and every rank raises the same message.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached the training step; the optimizer step was not taken."""


def first_bad(values: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[int, ...] | None:
    """Index of the first non-finite element of `values` (where `mask` is set), or None."""
    bad = ~torch.isfinite(values.detach())
    if mask is not None:
        bad &= mask.bool()
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def describe_token(what: str, values: torch.Tensor, mask: torch.Tensor, rows: list, completion_ids: torch.Tensor,
                   offset: int) -> str | None:
    """`what` at the first non-finite completion token of a `[B, T]` tensor, or None if all are finite.

    `rows[i]` is the dataset row of sample i; `offset` is the micro-batch's first sample in the step's batch.
    """
    where = first_bad(values, mask)
    if where is None:
        return None
    i, t = where
    values = values.detach()
    count = int((~torch.isfinite(values.detach()) & mask.bool()).sum())
    return (f"{what} is {float(values[i, t])} at sample {offset + i} of the batch (dataset row {rows[i]}), "
            f"completion token {t} (id {int(completion_ids[i, t])}); {count} non-finite token(s) in this micro-batch")


def agree(problems: list[str], *, step: int, rank_name: str) -> None:
    """Collective over the trainer world: if any rank lists a problem, every rank raises `NonFiniteError`."""
    flag = torch.tensor([1.0 if problems else 0.0])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    mine = [f"{rank_name}: {p}" for p in problems]
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        found = [p for rank_problems in everyone for p in rank_problems]
    else:
        found = mine
    more = f" (and {len(found) - 1} more: {'; '.join(found[1:3])})" if len(found) > 1 else ""
    raise NonFiniteError(
        f"non-finite values at step {step}, {found[0]}{more}. The step was stopped before the optimizer: the weights "
        "hold no NaN/inf. Check the learning rate, the reward functions and the generator's dtype; with bf16, try "
        "fp32 or a lower learning rate.")


def first_bad_gradient(model: torch.nn.Module) -> str | None:
    """The first parameter whose gradient (this rank's shard) holds a NaN or inf, described; or None."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        where = first_bad(grad)
        if where is not None:
            return f"the gradient of {name} is {float(grad[where])} at {list(where)} (this rank's shard)"
    return None


def total_grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    """The gradients' global L2 norm (a collective under FSDP2), clipping them to `max_norm` when it is > 0. With
    trainer tensor parallelism the gradients live on two meshes (the 2-D one of the split layers, the data-parallel
    one of what tensor parallelism keeps whole): each mesh's norm is reduced over it, then they are combined."""
    params = [p for p in model.parameters() if p.grad is not None]
    meshes: dict[str, list[torch.Tensor]] = {}
    for p in params:
        mesh = getattr(p.grad, "device_mesh", None)
        meshes.setdefault("" if mesh is None else f"{mesh.mesh.tolist()}{mesh.mesh_dim_names}", []).append(p.grad)
    if len(meshes) <= 1:
        if max_norm and max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    squares = 0.0
    for grads in meshes.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        squares += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    total = math.sqrt(squares)
    if max_norm and max_norm > 0 and math.isfinite(total):
        coef = min(1.0, max_norm / (total + 1e-6))  # (torch's clip_grad_norm_ arithmetic)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return total


def nonfinite_problems(batch: dict, logprobs: torch.Tensor, advantages: torch.Tensor, loss: torch.Tensor,
                       chunk: list, offset: int) -> list[str]:
    """What in the trainer's micro-batch is NaN or inf, described (empty: all finite); `chunk`: its rollouts,
    `offset`: the first one's place in the batch."""
    rows = [r.row_index for r in chunk]
    ids, mask = batch["completion_ids"], batch["mask"]
    problems = [describe_token(what, values, mask, rows, ids, offset) for what, values in (
        ("mu (the generator's log-prob of the sampled token)", batch["behavior_logprobs"]),
        ("pi (the policy's log-prob of the sampled token)", logprobs))]
    bad = first_bad(advantages)
    if bad is not None:
        i = bad[0]
        problems.append(f"the advantage is {float(advantages[i])} at sample {offset + i} of the batch "
                        f"(dataset row {rows[i]})")
    if not problems[0] and not problems[1] and bad is None and not bool(torch.isfinite(loss.detach())):
        problems.append(f"the loss is {float(loss.detach())} (pi, mu and the advantages are finite: the algorithm's loss)")
    return [p for p in problems if p]
