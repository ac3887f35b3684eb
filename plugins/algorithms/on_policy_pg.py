"""On-policy policy gradient: no importance weight (the paper's synchronous baseline).

Per token: loss = - A * log pi_t, token mean; A = r - mean(r of the group). Correct only when
samples come from the current policy (`max_staleness=0`); with stale samples it is the
"no importance weight" ablation.
"""

from __future__ import annotations

import torch

from .aipo import group_advantages, masked_mean, ratio_metrics


class OnPolicyPG:
    """The `on_policy_pg` algorithm plugin."""

    def __init__(self, scale_rewards: str = "none", **unused):
        self.scale_rewards = scale_rewards

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs, behavior_logprobs, advantages, mask):
        mask = mask.to(logprobs.dtype)
        loss = masked_mean(-advantages[:, None] * logprobs, mask)
        metrics = ratio_metrics(torch.exp(logprobs.detach() - behavior_logprobs), mask)
        metrics["clipped_frac"] = 0.0
        return loss, metrics
