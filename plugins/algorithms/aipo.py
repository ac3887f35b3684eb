"""AIPO: asynchronous importance-weighted policy optimisation (LlamaRL, arXiv 2505.24034, section 5).

For every completion token t of a sample with advantage A:

    w_t  = min(pi_t / mu_t, rho)        # a constant: no gradient flows through it
    loss = - mean_t( w_t * A * log pi_t )  # token mean over the completion tokens (mask)

with pi the current policy, mu the behaviour policy that sampled the token (the generator's
log-prob, possibly several versions old) and A = r - mean(r over the prompt's group).

Unlike PPO's clip, a token whose ratio is clipped still gets gradient `rho * A * grad log pi`:
the clip bounds the variance of the weight, it does not stop learning from the token.
"""

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
    return (x * mask).sum() / mask.sum().clamp(min=1)


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate on the sampled tokens, TRL's (k3) estimator:
    exp(ref - logp) - (ref - logp) - 1 >= 0, zero where pi == pi_ref. Gradient flows through `logprobs`."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


@torch.no_grad()
def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Importance-ratio statistics over the completion tokens, and the KL between the behaviour and the
    current policy on the sampled tokens (k3 estimator: E[r - 1 - log r] with r = pi/mu)."""
    r = ratio[mask.bool()].float()
    if not r.numel():
        return {"is_ratio_mean": 1.0, "is_ratio_max": 1.0, "is_ratio_min": 1.0, "behavior_kl": 0.0}
    return {"is_ratio_mean": r.mean().item(), "is_ratio_max": r.max().item(), "is_ratio_min": r.min().item(),
            "behavior_kl": (r - 1 - torch.log(r)).mean().item()}


class AIPO:
    """The `aipo` algorithm plugin.

    Args:
        rho: upper clip of the importance ratio pi/mu (paper: 2..10).
        scale_rewards: "none" (default, the paper's advantage), "group" or "batch".
    """

    def __init__(self, rho: float = 4.0, scale_rewards: str = "none", **unused):
        if rho < 1.0:
            raise ValueError(f"AIPO: rho={rho} must be >= 1")
        self.rho, self.scale_rewards = float(rho), scale_rewards

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """`[B*G]` rewards -> `[B*G]` advantages."""
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(
        self,
        logprobs: torch.Tensor,  # [B, T] log pi of the sampled tokens (with grad)
        behavior_logprobs: torch.Tensor,  # [B, T] log mu, from the generator
        advantages: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, T] 1 on completion tokens
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mask.to(logprobs.dtype)
        ratio = torch.exp(logprobs.detach() - behavior_logprobs)  # [B, T]
        weight = ratio.clamp(max=self.rho)
        per_token = -weight * advantages[:, None] * logprobs
        loss = masked_mean(per_token, mask)
        metrics = ratio_metrics(ratio, mask)
        r = ratio[mask.bool()]
        metrics["clipped_frac"] = (r > self.rho).float().mean().item() if r.numel() else 0.0
        return loss, metrics
