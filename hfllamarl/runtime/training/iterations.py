"""Per-step pieces of TRL's `num_iterations`, `top_entropy_quantile` and `sync_ref_model`, on the trainer ranks.

- pi_old (`num_iterations > 1`): the policy's log-probs before a batch's first optimizer pass. They are the first
  pass's own log-probs, detached, kept per micro-batch (no extra forward pass); later passes hand them to the
  algorithm as `old_logprobs`, which clips the ratio pi / pi_old as TRL's loss does.
- The entropy mask (`top_entropy_quantile = q`): per micro-batch, the completion tokens whose entropy is at least
  the (1 - q) quantile of the entropies of the completion tokens of that micro-batch on every trainer rank (TRL
  gathers them across processes per micro-step too, `GRPOTrainer.get_high_entropy_mask`). It multiplies the
  per-token loss.
- Off-policy corrections: each token's staleness (policy versions between its sampler and pi_old) for a loss that
  names `staleness`, and a correction's step size: `step_scale` gathers log(pi_old/mu) of every sequence of the step
  over the trainer ranks and the optimizer step runs at the factor the correction returns (`scaled_lr`).
- Reference sync (`sync_ref_model`): after every `ref_model_sync_steps`-th optimizer step, each trainer rank mixes
  its own shard of the reference model toward its shard of the policy, ref <- alpha * policy + (1 - alpha) * ref
  (TRL's `SyncRefModelCallback`, on the parameters); nothing is gathered, since both are sharded alike.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

_PAD = -1e9  # a sentinel no entropy can take (entropies are >= 0)


def skips_flat_rows(spec, balancing) -> bool:
    """Whether the trainer skips the forward and backward of rows whose advantage is 0 (`rows_to_train`): asked for
    (`skip_flat_rows`, whose config check refuses a loss that does not keep rows apart), and nothing else in the step
    reads every row (a reference model's KL, the entropy mask's quantile; an MoE's balancing loss is refused here)."""
    if not spec.skip_flat_rows:
        return False
    if balancing is not None:
        raise ValueError("skip_flat_rows=True: the MoE load-balancing loss (router_aux_loss_coef) reads every row's "
                         "router logits, so no row can be skipped; leave skip_flat_rows False for this model.")
    return (bool(getattr(spec.algorithm, "rows_apart", False)) and spec.ref_model is None
            and spec.top_entropy_quantile >= 1.0 and not scales_steps(spec.algorithm))


def rows_to_train(advantages, skip: bool) -> list[int]:
    """The rows of this rank's batch that run forward and backward: with `skip` (`skips_flat_rows`) the rows whose
    advantage is not 0 (a group whose rewards are all equal has none: GRPO's flat groups, often most of a late
    batch), topped up in order with skipped ones until every data-parallel rank runs as many rows (so as many
    micro-batches: their gradient reduction is collective), and at least one (the step's metrics); else every row.
    The step's token count, the loss's normaliser, still counts every row, so the loss and gradient are those of the
    whole batch."""
    n = len(advantages)
    if not skip or not n:
        return list(range(n))
    kept = [i for i in range(n) if float(advantages[i]) != 0.0]
    count = max(len(kept), 1)
    from hfllamarl.runtime.world.mesh import data_group, data_world_size

    if data_world_size() > 1:
        t = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=data_group())
        count = int(t)
    chosen = set(kept)
    for i in range(n):
        if len(chosen) >= count:
            break
        chosen.add(i)
    return sorted(chosen)


def skips_flat_backward(spec, balancing, skips_rows: bool) -> bool:
    """Whether rows whose advantage is 0 run forward only (`forward_only_plan`): asked for (`skip_flat_backward`, the
    default), not skipped whole already (`skips_flat_rows`), and no gradient reaches the weights through such a row:
    the algorithm says so (`flat_rows_inert`: every per-token term is proportional to the row's advantage, the
    weights detached), no KL to a reference model and no MoE balancing loss (both read every row's forward)."""
    return (spec.skip_flat_backward and not skips_rows and balancing is None
            and spec.ref_model is None and bool(getattr(spec.algorithm, "flat_rows_inert", False)))


def forward_only_plan(advantages, micro_batch_size: int, on: bool) -> list[tuple[list[int], list[int], bool]]:
    """This rank's micro-batches (its rows in order, `micro_batch_size` at a time, as without the plan), each as
    (rows run forward and backward, rows run forward only, whether a forward-only pass runs with none of its own).

    With `on` (`skips_flat_backward`), a row whose advantage is 0 runs forward only: its log-probs and entropy still
    enter the micro-batch's loss and metrics, which are therefore the whole micro-batch's, but it adds exactly nothing
    to the gradient, so its backward is left out. FSDP's forward and backward passes are collective, so every
    data-parallel rank runs the same passes per micro-batch: where any rank has a row with signal, every rank runs a
    backward (a rank with none runs its first flat row with gradient, which adds 0), and where any rank has a flat
    row, every rank runs a forward-only pass (a rank with none runs one of its rows again and drops the result).
    When no rank has a row with signal at all, one row of the first micro-batch runs with gradient (zeros): the
    optimizer still steps, as it does over a flat batch without the plan."""
    n = len(advantages)
    bounds = [(k, min(k + micro_batch_size, n)) for k in range(0, n, micro_batch_size)]
    if not on:
        return [(list(range(a, b)), [], False) for a, b in bounds]
    flat = [float(a) == 0.0 for a in advantages]
    flags = torch.tensor([[int(not all(flat[a:b])), int(any(flat[a:b]))] for a, b in bounds], dtype=torch.long)
    from hfllamarl.runtime.world.mesh import data_group, data_world_size

    if data_world_size() > 1 and len(bounds):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=data_group())
    if len(bounds) and not bool(flags[:, 0].any()):
        flags[0, 0] = 1  # (every rank then runs one flat row of its first micro-batch with gradient)
    plan = []
    for k, (a, b) in enumerate(bounds):
        grad = [i for i in range(a, b) if not flat[i]]
        rest = [i for i in range(a, b) if flat[i]]
        if flags[k, 0] and not grad:  # another rank (or the wholly flat step) runs a backward here
            grad, rest = rest[:1], rest[1:]
        plan.append((grad, rest, bool(flags[k, 1]) and not rest))
    return plan


def loss_keywords(algorithm) -> set[str]:
    """Which optional inputs the algorithm's `loss` names, of `old_logprobs`, `entropy_mask`, `staleness` and
    `shape` (the step's `StepShape`)."""
    return {"old_logprobs", "entropy_mask", "staleness", "shape"} & set(inspect.signature(algorithm.loss).parameters)


def token_staleness(rollouts, version: int, shape, device) -> torch.Tensor:
    """`[B, T]` float: `version` minus the policy version that sampled each completion token (0 past the end)."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        if r.versions:
            out[i, :len(r.versions)] = torch.tensor([version - v for v in r.versions], dtype=torch.float32)
    return out.to(device)


def scales_steps(algorithm) -> bool:
    """Whether the algorithm sets each optimizer step's learning-rate factor (`step_scale`)."""
    return callable(getattr(algorithm, "step_scale", None)) and bool(getattr(algorithm, "scales_steps", True))


def step_scale(algorithm, sequence_log_weights: list[torch.Tensor]) -> dict[str, list[float]]:
    """The algorithm's learning-rate factor for this optimizer step, from log(pi_old/mu) of this rank's sequences (one
    `[B]` tensor per micro-batch) gathered over the trainer ranks, as the trainer's per-micro-batch stats: the factor
    under "_step_scale" (taken out before logging) and the algorithm's metrics. Every rank calls it."""
    local = torch.cat(sequence_log_weights).float() if sequence_log_weights else torch.zeros(0)
    factor, metrics = algorithm.step_scale(_gather_padded(local.cpu()))
    return {"_step_scale": [factor], **{key: [value] for key, value in metrics.items()}}


@contextlib.contextmanager
def scaled_lr(optimizer, factor: float | None):
    """The optimizer's learning rates times `factor` while this lasts (None or 1: unchanged)."""
    if factor is None or factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """TRL's entropy mask: 1.0 on completion tokens whose entropy is >= the `1 - quantile` quantile of every trainer
    rank's completion-token entropies of this micro-batch, else 0.0 (padding always 0).

    Args:
        entropies: `[B, T]` per-token entropy of the policy's distribution.
        mask: `[B, T]` 1 on completion tokens.
        quantile: TRL's `top_entropy_quantile` (the share of tokens kept).
    """
    entropies = entropies.detach()
    local = entropies[mask.bool()].float()
    values = _gather_padded(local)
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.float32)
    threshold = torch.quantile(values, 1.0 - quantile)
    return ((entropies >= threshold) & mask.bool()).float()


def _gather_padded(local: torch.Tensor) -> torch.Tensor:
    """`local` of every trainer rank, concatenated (the ranks' lengths differ: padded with a sentinel, then dropped)."""
    from hfllamarl.runtime.world.mesh import data_group, data_world_size

    world, group = data_world_size(), data_group()  # (a tensor-parallel group's ranks hold the same tokens)
    if world == 1:
        return local
    size = torch.tensor([local.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.full((width,), _PAD, dtype=torch.float32)
    padded[:local.numel()] = local.cpu()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    out = torch.cat(parts)
    return out[out != _PAD].to(local.device)


@torch.no_grad()
def _resharded(model: torch.nn.Module) -> None:
    """Put every FSDP2 unit of `model` back in its sharded state. FSDP2 keeps the root unit's parameters gathered
    after a forward pass (the reference's, after its no-grad forward): the module then holds plain gathered copies,
    and changing those would be lost at the next reshard."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def mix_reference(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter, on this rank's shards (FSDP2 DTensors:
    their local parts; both models are sharded with the same plan, so the parts line up)."""
    _resharded(policy)
    _resharded(reference)
    ours = dict(policy.named_parameters())
    theirs = dict(reference.named_parameters())
    if ours.keys() != theirs.keys():
        missing = sorted(set(ours) ^ set(theirs))[:3]
        raise RuntimeError(f"sync_ref_model: the reference model's parameters differ from the policy's ({missing})")
    for name, ref in theirs.items():
        src = ours[name]
        ref_local = ref.to_local() if hasattr(ref, "to_local") else ref.data
        src_local = src.to_local() if hasattr(src, "to_local") else src.data
        if ref_local.shape != src_local.shape:
            raise RuntimeError(f"sync_ref_model: {name} is sharded differently in the reference "
                               f"{tuple(ref_local.shape)} and the policy {tuple(src_local.shape)}")
        ref_local.mul_(1.0 - alpha).add_(src_local.to(ref_local.dtype), alpha=alpha)
