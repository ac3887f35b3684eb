"""An example hfllamarl algorithm plugin: ``aipo_seq_mean``.

AIPO's per-token weight ``w_t = min(pi_t / mu_t, rho)`` (no gradient through it), but the loss is averaged
over each completion's tokens first and then over completions, so a short and a long completion weigh the
same (the original GRPO normalisation), instead of AIPO's mean over all tokens of the batch:

    loss = - mean_i( mean_{t in i}( w_t * A_i * log pi_t ) )  (+ beta * KL to the reference)

It follows ``hfllamarl.contracts.Algorithm`` and builds on the core's helpers (``hfllamarl.losses``); it
logs one metric of its own, ``seq_mean/weight_mean`` (the mean clipped weight), next to the core's.
Imported only when named (``algorithm="aipo_seq_mean"``): the reward module stays standard-library only.
"""

from __future__ import annotations

import torch

from hfllamarl.losses import add_kl, group_advantages, ratio_metrics


class SequenceMeanAIPO:
    """Args: rho (config `aipo_rho`), scale_rewards, beta."""

    def __init__(self, rho: float = 4.0, scale_rewards: str = "none", beta: float = 0.0):
        if rho < 1.0:
            raise ValueError(f"aipo_seq_mean: rho={rho} must be >= 1")
        self.rho, self.scale_rewards, self.beta = float(rho), scale_rewards, float(beta)

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs, behavior_logprobs, advantages, mask, ref_logprobs=None):
        mask = mask.to(logprobs.dtype)
        ratio = torch.exp(logprobs.detach() - behavior_logprobs)  # [B, T]
        weight = ratio.clamp(max=self.rho)
        per_token = -weight * advantages[:, None] * logprobs * mask
        lengths = mask.sum(dim=1)
        has_tokens = lengths > 0
        per_sequence = per_token.sum(dim=1)[has_tokens] / lengths[has_tokens]
        loss = per_sequence.mean() if per_sequence.numel() else (per_token.sum() * 0.0)
        metrics = ratio_metrics(ratio, mask)
        valid = mask.bool()
        metrics["seq_mean/weight_mean"] = weight[valid].mean().item() if valid.any() else 1.0
        return add_kl(loss, metrics, logprobs, ref_logprobs, mask, self.beta), metrics
