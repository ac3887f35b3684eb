"""Building blocks of algorithm plugins (`hfllamarl.contracts.Algorithm`), shared by the built-ins and open to
third-party algorithms. Shapes: B samples, T completion tokens; `mask` is 1 on completion tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation of `x` over `dim` (all of it when None) ignoring NaNs, with Bessel's correction; NaN
    where fewer than two values are not NaN (as TRL's `nanstd`)."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=dims, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.full_like(var, math.nan))
    return std if keepdim else std.squeeze() if dim is None else std.squeeze(dim)


def global_nan_moments(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the non-NaN `values` of every trainer rank that holds different data (the trainer world, or with
    trainer tensor parallelism one rank of each tensor-parallel group), std with Bessel's correction and NaN below two values; two all-reduces, the
    second over the deviations from the global mean (exact, no sum-of-squares cancellation). Every trainer rank
    must call it."""
    kept = values[~torch.isnan(values)].double()
    stats = torch.stack([torch.tensor(float(kept.numel()), dtype=torch.float64), kept.sum()])
    from hfllamarl.runtime.world.mesh import data_group, data_world_size

    distributed, group = data_world_size() > 1, data_group()
    if distributed:
        torch.distributed.all_reduce(stats, group=group)
    count, total = stats.tolist()
    mean = total / count if count else math.nan
    squares = ((kept - mean) ** 2).sum().reshape(1) if count else torch.zeros(1, dtype=torch.float64)
    if distributed:
        torch.distributed.all_reduce(squares, group=group)
    std = math.sqrt(squares.item() / (count - 1)) if count > 1 else math.nan
    return torch.tensor(mean, dtype=values.dtype), torch.tensor(std, dtype=values.dtype)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none") -> torch.Tensor:
    """`[B*G]` rewards -> `[B*G]` advantages: reward minus its group's mean, as TRL's "sum_then_normalize".

    A NaN reward (an unscored completion: every reward function returned None) is left out of its group's mean and
    of every std, and gets advantage 0, as TRL's nanmean/nanstd and its final `nan_to_num` do (so does a completion
    whose group has a single scored member under "group": its std is NaN). A group whose scored rewards are all equal
    gets exactly 0 (its mean, a float sum over the group, can round to a hair off them), so that the trainer knows its
    rows add nothing (`skip_flat_backward`).

    Args:
        rewards: `[B*G]`, the G completions of each prompt contiguous.
        group_size: G.
        scale: "none" (the paper's A = r - mean), "group" (divide by the group's std, as GRPO) or
            "batch" (divide by the std of the rewards of the whole step, over every trainer rank).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    check_choice("scale_rewards", scale, ("none", "group", "batch"))
    grouped = rewards.view(-1, group_size)  # [B, G]
    adv = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    scored = ~torch.isnan(grouped)  # a group whose scored rewards are all equal: exactly 0 (the mean can round)
    flat = (torch.where(scored, grouped, torch.inf).amin(1, keepdim=True)
            == torch.where(scored, grouped, -torch.inf).amax(1, keepdim=True))
    adv = adv.masked_fill(flat, 0.0)
    if scale == "group":
        adv = adv / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (global_nan_moments(rewards)[1] + 1e-4)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def normalize_then_sum_advantages(scores: torch.Tensor, weights, group_size: int) -> torch.Tensor:
    """TRL's `multi_objective_aggregation="normalize_then_sum"`: each reward function's scores are normalised
    within each group, `(s_k - nanmean_group(s_k)) / (nanstd_group(s_k) + 1e-4)`, summed with the reward weights
    (NaN terms left out), and the sum normalised over the whole step (every trainer rank):
    `A = (R - nanmean(R)) / (nanstd(R) + 1e-4)`. A completion no function scored gets 0; `scale_rewards` plays no
    part (as in TRL).

    Args:
        scores: `[N, K]` each function's score per completion, NaN where it returned None.
        weights: K reward weights.
        group_size: G (the G completions of each prompt contiguous).
    """
    n, k = scores.shape
    if n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    grouped = scores.view(-1, group_size, k)
    std = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
    normalised = ((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (std + 1e-4)).view(n, k)
    total = (normalised * torch.as_tensor(weights, dtype=scores.dtype)[None, :]).nansum(dim=1)
    total[torch.isnan(scores).all(dim=1)] = math.nan
    mean, std_all = global_nan_moments(total)
    return torch.nan_to_num((total - mean) / (std_all + 1e-4), nan=0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the tokens where `mask` is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate on the sampled tokens, TRL's (k3) estimator:
    exp(ref - logp) - (ref - logp) - 1 >= 0, zero where pi == pi_ref. Gradient flows through `logprobs`."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def add_kl(loss: torch.Tensor, metrics: dict, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
           mask: torch.Tensor, beta: float) -> torch.Tensor:
    """`loss + beta * mean_t KL(pi || pi_ref)` (TRL's estimator and token mean), logging `kl`; `loss` as is
    without a reference (`ref_logprobs` None, i.e. beta == 0)."""
    if ref_logprobs is None or beta == 0:
        return loss
    kl = masked_mean(reference_kl(logprobs, ref_logprobs), mask)
    metrics["kl"] = kl.item()
    return loss + beta * kl


# Below this log pi/mu the ratio is 0 in float32 (pi = 0 in floating point, or a token outside the current policy's
# truncated support, whose log-prob is `sampling.OUTSIDE_LOGPROB`): k3 = r - 1 - log r says nothing there.
MIN_LOG_RATIO = math.log(torch.finfo(torch.float32).tiny)  # about -87.3


@torch.no_grad()
def behavior_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """KL(mu || pi) between the behaviour policy mu (which sampled the tokens) and the current policy pi, estimated
    on the sampled tokens with the k3 estimator: mean_t (r - 1 - log r), r = pi/mu, computed from the log-ratio
    l as `expm1(l) - l` in float64 (exactly r - 1 - log r, and finite, wherever r is).

    Tokens outside pi's support (l below `MIN_LOG_RATIO` or not finite: pi is 0 in floating point) are left out
    of the mean: there the estimate is unbounded, and one such token would make the whole mean inf. Their share
    of the completion tokens is returned next to it (logged as `behavior_kl/excluded_frac`), so a policy that
    moved its support away from what the generator sampled is still seen.

    Returns:
        (the k3 mean over the tokens within support, 0.0 when there are none; the share of tokens left out).
    """
    log_ratio = log_ratio.detach()[mask.bool()].double()
    if not log_ratio.numel():
        return 0.0, 0.0
    inside = torch.isfinite(log_ratio) & (log_ratio >= MIN_LOG_RATIO)
    kept = log_ratio[inside]
    k3 = (torch.expm1(kept) - kept).mean().item() if kept.numel() else 0.0
    return k3, 1.0 - inside.double().mean().item()


@torch.no_grad()
def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor, log_ratio: torch.Tensor | None = None) -> dict[str, float]:
    """Importance-ratio statistics over the completion tokens, named as they are logged, and the KL between the
    behaviour and the current policy on the sampled tokens (`behavior_kl`, and `behavior_kl/excluded_frac` the
    share of tokens outside pi's support it leaves out). Pass `log_ratio` (log pi - log mu) where it is at hand:
    everything is then computed from it in float64 (a ratio past float32's range stays finite)."""
    log_ratio = (torch.log(ratio.detach().double()) if log_ratio is None else log_ratio.detach().double())
    values = log_ratio[mask.bool()]
    if not values.numel():
        return {"is_ratio/mean": 1.0, "is_ratio/max": 1.0, "is_ratio/min": 1.0, "behavior_kl": 0.0,
                "behavior_kl/excluded_frac": 0.0}
    r = torch.exp(torch.nan_to_num(values, nan=-math.inf))  # (a NaN log-ratio is the non-finite guard's to report)
    kl, excluded = behavior_kl(log_ratio, mask)
    return {"is_ratio/mean": r.mean().item(), "is_ratio/max": r.max().item(), "is_ratio/min": r.min().item(),
            "behavior_kl": kl, "behavior_kl/excluded_frac": excluded}


# ---------------------------------------------------------------------------------------------------------------
# The loss menu: TRL's GRPOTrainer formulas (trl/trainer/grpo_trainer.py, `_compute_loss` and the vLLM importance-
# sampling correction), as building blocks. Three log-probs meet here: log pi (current policy, with gradient),
# log pi_old (the policy the PPO-style ratio refers to; with one optimizer step per batch it is the current policy
# before the step, i.e. log pi detached, as in TRL with num_iterations=1) and log mu (the generator's, which
# sampled the token, maybe several versions stale). The behaviour weight pi_old/mu is what corrects staleness.

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's double clip
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{what}={value!r}; choose one of {', '.join(map(repr, choices))}.")


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log importance weight: the token mean of `log_ratio` over the mask, `[B, 1]`."""
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """TRL's `coef_1`: pi/pi_old per token `[B, T]` ("token") or GSPO's per sequence `[B, 1]` ("sequence")."""
    check_choice("importance_sampling_level", level, ("token", "sequence"))
    log_ratio = logprobs - old_logprobs
    return torch.exp(log_ratio if level == "token" else sequence_log_ratio(log_ratio, mask))


def per_token_objective(loss_type: str, coef_1: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor,
                        epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
                        sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05) -> torch.Tensor:
    """The per-token policy loss of `loss_type` (before masks, weights and normalisation), `advantages` `[B, 1]`:

    - grpo, bnpo, dr_grpo, dapo, luspo: `-min(c * A, clip(c, 1 - epsilon_low, 1 + epsilon_high) * A)`, where the
      first `c` is `min(c, delta)` when `delta` is set (two-sided clipping);
    - cispo: `-min(c, epsilon_high).detach() * A * log pi` (CISPO: the clipped weight carries no gradient);
    - sapo: `-sigmoid(tau * (c - 1)) * 4 / tau * A`, tau = the positive or negative temperature by the sign of A.
    """
    check_choice("loss_type", loss_type, LOSS_TYPES)
    if loss_type == "vespo":
        raise ValueError("loss_type='vespo' weights whole sequences: use `vespo_weight` (it needs the mask)")
    if loss_type == "cispo":
        return -coef_1.clamp(max=epsilon_high).detach() * advantages * logprobs
    if loss_type == "sapo":
        tau = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        return -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages
    coef_2 = coef_1.clamp(1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = coef_1.clamp(max=delta)
    return -torch.minimum(coef_1 * advantages, coef_2 * advantages)


@torch.no_grad()
def behavior_weight(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                    clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's vLLM importance-sampling correction pi_old/mu, here also the staleness correction: per token `[B, T]`
    or per sequence `[B, 1]` (the product over its tokens, i.e. exp of the summed log difference); "truncate"
    clamps it into [clip_min, clip_max], "mask" sets it to 0 outside (None: no bound on that side)."""
    check_choice("vllm_importance_sampling_mode", mode, IS_MODES)
    diff = torch.nan_to_num((old_logprobs - behavior_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def off_policy_mask(advantages: torch.Tensor, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2), `[B, 1]`: a sequence is dropped (0) when its advantage is
    negative and its mean KL(mu || pi) over the sampled tokens, `mean_t(log mu - log pi)`, exceeds `threshold`."""
    kl = torch.nan_to_num(behavior_logprobs - logprobs.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


@torch.no_grad()
def vespo_weight(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                 behavior_weight_: torch.Tensor | None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                 k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO's sequence weight phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1), a constant `[B, 1]`, with
    (k, lambda) by the sign of A (A >= 0: the positive pair), as TRL computes it:

        log w = sum_t clamp(log pi/pi_old, -20, 20) + sum_t clamp(log b_t, log 1e-8, 20), clamped to [log 1e-8, 20]

    where `log_ratio` is log pi - log pi_old `[B, T]` and `behavior_weight_` the token correction b = pi_old/mu
    (`behavior_weight` in a token mode; None without correction). A non-finite phi is 0.
    """
    floor = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if behavior_weight_ is not None:
        log_w = log_w + torch.log(behavior_weight_).clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, k_pos, k_neg)
    lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class StepShape:
    """What a loss normalisation needs beyond its micro-batch (`hfllamarl.contracts.Algorithm.loss`'s `shape`).

    tokens: completion tokens of the whole step (its mask summed over every micro-batch and trainer rank);
    trainer_ranks, micro_batches: the trainer divides each micro-batch's loss by `micro_batches`, and gradients are
    averaged over `trainer_ranks`; max_completion_length: Dr. GRPO's constant.
    """

    tokens: float
    trainer_ranks: int = 1
    micro_batches: int = 1
    max_completion_length: int | None = None

    @classmethod
    def of(cls, mask: torch.Tensor) -> "StepShape":
        """A step of this one micro-batch on one rank (the loss called on its own, e.g. in a test)."""
        return cls(tokens=float(mask.sum()), max_completion_length=mask.shape[-1])


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, shape: StepShape) -> torch.Tensor:
    """A micro-batch's scalar loss from its per-token losses, normalised as TRL's `loss_type` (after the trainer
    divides by the micro-batches and averages the gradient over ranks):

    - grpo, sapo: each sequence's token mean, averaged over the sequences;
    - bnpo: the token mean of the micro-batch;
    - dr_grpo: the token sum over (sequences x max_completion_length);
    - dapo, cispo, vespo: the token sum over the step's tokens on every rank (one weight per token of the whole step);
    - luspo: each sequence's token sum, averaged over the sequences.
    """
    check_choice("loss_type", loss_type, LOSS_TYPES)
    per_token = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return per_token.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = shape.max_completion_length or mask.shape[-1]
        return per_token.sum() / (per_token.shape[0] * length)
    if loss_type == "luspo":
        return per_token.sum(-1).mean()
    return per_token.sum() * shape.micro_batches / max(shape.tokens / shape.trainer_ranks, 1.0)


@torch.no_grad()
def weight_metrics(prefix: str, weight: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """min/mean/max of a per-token `[B, T]` or per-sequence `[B, 1]` weight over the completion tokens."""
    values = weight[mask.bool()] if weight.shape == mask.shape else weight[mask.sum(-1) > 0].flatten()
    if not values.numel():
        return {}
    values = values.float()
    return {f"{prefix}/min": values.min().item(), f"{prefix}/mean": values.mean().item(),
            f"{prefix}/max": values.max().item()}
