"""Log-probs and entropies on vocabulary-sharded logits (trainer tensor parallelism), never gathered whole.

With an untied output layer split by vocabulary rows (`hfllamarl.runtime.weights.tensor_parallel`), each rank of a
tensor-parallel group holds the logits of its slice of the vocabulary, `[N, V / t]`. Per position:

    log pi(token) = x[token] - logsumexp(x),   logsumexp(x) = m + log(sum over ranks of sum(exp(x_local - m)))

with m the maximum over every rank (a constant: no gradient flows through it), and x[token] found on the one rank
whose slice holds the token (the others contribute 0 to a sum). Two sums over the group per micro-batch, `[N]`
floats each, in place of an all-gather of `[N, V]` logits. The sums' backward is the identity: every rank of the
group computes the same loss from the summed values, so each rank's slice gets exactly its own gradient (torch's
`distributed.nn` all-reduce would sum the group's identical gradients, t times too large).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group; backward: the gradient as it is (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def is_sharded(logits) -> bool:
    """Whether `logits` is a DTensor sharded over the vocabulary (its last dimension)."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(logits, DTensor) and any(isinstance(p, Shard) and p.dim in (-1, logits.dim() - 1)
                                               for p in logits.placements)


def shard_of(logits) -> tuple[torch.Tensor, int, object]:
    """(this rank's logits `[..., V / t]`, the vocabulary id of its first column, the group's process group)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, tuple(logits.placements))
    return logits.to_local(), int(offset[-1]), logits.device_mesh.get_group()


def token_logprobs(x: torch.Tensor, start: int, tokens: torch.Tensor, group) -> torch.Tensor:
    """`x [N, V/t]` (this rank's float logits, already scaled), `tokens [N]` -> log pi `[N]`, the same on every rank."""
    with torch.no_grad():
        m = x.amax(dim=-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = _SumOverGroup.apply(torch.exp(x - m.unsqueeze(-1)).sum(dim=-1), group)
    local = tokens - start
    here = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = _SumOverGroup.apply(torch.where(here, picked, torch.zeros_like(picked)), group)
    return picked - (m + torch.log(total))


def entropies(x: torch.Tensor, group, rows: int = 4096) -> torch.Tensor:
    """`x [N, V/t]` -> the entropy of each row's full distribution `[N]`, without gradient."""
    out = []
    with torch.no_grad():
        for chunk in x.split(rows):
            m = chunk.amax(dim=-1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            shifted = chunk - m.unsqueeze(-1)
            e = torch.exp(shifted)
            sums = torch.stack([e.sum(-1), (e * shifted.masked_fill(torch.isneginf(shifted), 0.0)).sum(-1)])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            out.append(torch.log(sums[0]) - sums[1] / sums[0])  # H = log Z - E[x - m]
    return torch.cat(out)
