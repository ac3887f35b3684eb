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

from hfllamarl.losses import add_kl, group_advantages, masked_mean, ratio_metrics


class AIPO:
    """The `aipo` algorithm plugin.

    Args:
        rho: upper clip of the importance ratio pi/mu (paper: 2..10; config `aipo_rho`).
        scale_rewards: "none" (default, the paper's advantage), "group" or "batch".
        beta: coefficient of the KL term to the reference model (0: none).
    """

    def __init__(self, rho: float = 4.0, scale_rewards: str = "none", beta: float = 0.0):
        if rho < 1.0:
            raise ValueError(f"AIPO: rho={rho} must be >= 1")
        self.rho, self.scale_rewards, self.beta = float(rho), scale_rewards, float(beta)

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """`[B*G]` rewards -> `[B*G]` advantages."""
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(
        self,
        logprobs: torch.Tensor,  # [B, T] log pi of the sampled tokens (with grad)
        behavior_logprobs: torch.Tensor,  # [B, T] log mu, from the generator
        advantages: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, T] 1 on completion tokens
        ref_logprobs: torch.Tensor | None = None,  # [B, T] under the reference model (beta > 0)
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mask.to(logprobs.dtype)
        ratio = torch.exp(logprobs.detach() - behavior_logprobs)  # [B, T]
        weight = ratio.clamp(max=self.rho)
        per_token = -weight * advantages[:, None] * logprobs
        loss = masked_mean(per_token, mask)
        metrics = ratio_metrics(ratio, mask)
        r = ratio[mask.bool()]
        metrics["clipped_frac"] = (r > self.rho).float().mean().item() if r.numel() else 0.0
        return add_kl(loss, metrics, logprobs, ref_logprobs, mask, self.beta), metrics
