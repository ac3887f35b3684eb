"""Building blocks of algorithm plugins (`hfllamarl.contracts.Algorithm`), shared by the built-ins and open to
third-party algorithms. Shapes: B samples, T completion tokens; `mask` is 1 on completion tokens."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none") -> torch.Tensor:
    """`[B*G]` rewards -> `[B*G]` advantages: reward minus its group's mean.

    Args:
        rewards: `[B*G]`, the G completions of each prompt contiguous.
        group_size: G.
        scale: "none" (the paper's A = r - mean), "group" (divide by the group's std, as GRPO) or
            "batch" (divide by the batch's std).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # [B, G]
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (grouped.std(dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    elif scale != "none":
        raise ValueError(f"scale must be 'none', 'group' or 'batch', not {scale!r}")
    return adv.reshape(-1)


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


@torch.no_grad()
def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Importance-ratio statistics over the completion tokens, named as they are logged, and the KL between the
    behaviour and the current policy on the sampled tokens (k3 estimator: E[r - 1 - log r] with r = pi/mu)."""
    r = ratio[mask.bool()].float()
    if not r.numel():
        return {"is_ratio/mean": 1.0, "is_ratio/max": 1.0, "is_ratio/min": 1.0, "behavior_kl": 0.0}
    return {"is_ratio/mean": r.mean().item(), "is_ratio/max": r.max().item(), "is_ratio/min": r.min().item(),
            "behavior_kl": (r - 1 - torch.log(r)).mean().item()}
