"""GRPO with PPO's double-sided clip (DeepSeekMath; TRL's `GRPOTrainer` loss, token-level mean).

Per completion token t with advantage A and ratio r_t = pi_t / mu_t (gradient flows through r_t):

    loss = - mean_t( min(r'_t * A, clip(r_t, 1 - epsilon, 1 + epsilon_high) * A) )

with r'_t = r_t, or with `delta` set (two-sided clipping, INTELLECT-2; TRL's `delta`) r'_t = min(r_t, delta),
which bounds the unclipped term of a negative-advantage token too. A clipped token gets no gradient
(unlike AIPO). Advantages: reward minus the group mean, divided
by the group's std unless `scale_rewards="none"`.
"""

from __future__ import annotations

import torch

from hfllamarl.losses import add_kl, group_advantages, masked_mean, ratio_metrics


class GRPO:
    """The `grpo` algorithm plugin. Args: epsilon (0.2), epsilon_high (default: epsilon), delta (None: off),
    scale_rewards, beta (KL coefficient, 0: none)."""

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None, scale_rewards: str = "group",
                 delta: float | None = None, beta: float = 0.0):
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon_high) if epsilon_high is not None else self.epsilon
        self.delta = None if delta is None else float(delta)
        self.scale_rewards, self.beta = scale_rewards, float(beta)

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs, behavior_logprobs, advantages, mask, ref_logprobs=None):
        mask = mask.to(logprobs.dtype)
        ratio = torch.exp(logprobs - behavior_logprobs)  # [B, T], with gradient
        adv = advantages[:, None]
        unclipped = (ratio if self.delta is None else ratio.clamp(max=self.delta)) * adv
        clipped = ratio.clamp(1 - self.epsilon, 1 + self.epsilon_high) * adv
        loss = masked_mean(-torch.minimum(unclipped, clipped), mask)
        metrics = ratio_metrics(ratio.detach(), mask)
        valid = mask.bool()
        out = ((ratio.detach() < 1 - self.epsilon) | (ratio.detach() > 1 + self.epsilon_high))[valid]
        metrics["clipped_frac"] = out.float().mean().item() if out.numel() else 0.0
        return add_kl(loss, metrics, logprobs, ref_logprobs, mask, self.beta), metrics
