"""On-policy policy gradient: no importance weight (the paper's synchronous baseline).

Per token: loss = - A * log pi_t, token mean; A = r - mean(r of the group). Correct only when
samples come from the current policy (`max_staleness=0`); with stale samples it is the
"no importance weight" ablation.
"""

from __future__ import annotations

import torch

from hfllamarl.losses import add_kl, group_advantages, masked_mean, ratio_metrics


class OnPolicyPG:
    """The `on_policy_pg` algorithm plugin. Args: scale_rewards, beta (KL coefficient, 0: none)."""

    def __init__(self, scale_rewards: str = "none", beta: float = 0.0):
        self.scale_rewards, self.beta = scale_rewards, float(beta)

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs, behavior_logprobs, advantages, mask, ref_logprobs=None):
        mask = mask.to(logprobs.dtype)
        loss = masked_mean(-advantages[:, None] * logprobs, mask)
        metrics = ratio_metrics(torch.exp(logprobs.detach() - behavior_logprobs), mask,
                                logprobs.detach() - behavior_logprobs)
        metrics["clipped_frac"] = 0.0
        return add_kl(loss, metrics, logprobs, ref_logprobs, mask, self.beta), metrics
