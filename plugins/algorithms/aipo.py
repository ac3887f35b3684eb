"""AIPO: asynchronous importance-weighted policy optimisation (LlamaRL, arXiv 2505.24034, section 5).

For every completion token t of a sample with advantage A:

    w_t  = min(pi_t / mu_t, rho)        # a constant: no gradient flows through it
    loss = - w_t * A * log pi_t          # normalised over the completion tokens as `loss_type` says

with pi the current policy, mu the behaviour policy that sampled the token (the generator's
log-prob, possibly several versions old) and A = r - mean(r over the prompt's group).

Unlike PPO's clip, a token whose ratio is clipped still gets gradient `rho * A * grad log pi`:
the clip bounds the variance of the weight, it does not stop learning from the token (CISPO's form,
with rho as its epsilon_high). Composable with TRL's settings where they mean something here:
`loss_type` picks the normalisation (grpo, bnpo, dr_grpo, dapo; default dapo, TRL's: one weight per
token of the step), `importance_sampling_level="sequence"` makes w GSPO's sequence weight
min(exp(mean_t log(pi_t / mu_t)), rho), `off_policy_mask_threshold` drops negative-advantage
sequences that drifted too far (TRL's off-policy mask).
"""

from __future__ import annotations

import torch

from hfllamarl.losses import (StepShape, aggregate, check_choice, group_advantages, off_policy_mask, ratio_metrics,
                              reference_kl, sequence_log_ratio)

NORMALISATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


class AIPO:
    """The `aipo` algorithm plugin.

    Args:
        rho: upper clip of the importance ratio pi/mu (paper: 2..10; config `aipo_rho`).
        scale_rewards: "none" (default, the paper's advantage), "group" or "batch".
        beta: coefficient of the KL term to the reference model (0: none).
        loss_type: the normalisation, as TRL's loss_type of that name ("dapo", TRL's default).
        importance_sampling_level: "token" (the paper) or "sequence" (GSPO's length-normalised weight).
        off_policy_mask_threshold: None (off), or TRL's off-policy sequence mask threshold.
    """

    def __init__(self, rho: float = 4.0, scale_rewards: str = "none", beta: float = 0.0, loss_type: str = "dapo",
                 importance_sampling_level: str = "token", off_policy_mask_threshold: float | None = None):
        if rho < 1.0:
            raise ValueError(f"AIPO: rho={rho} must be >= 1")
        if loss_type not in NORMALISATIONS:
            raise ValueError(f"loss_type={loss_type!r}: AIPO's objective is fixed (min(pi/mu, aipo_rho) * A * log pi, "
                             f"CISPO's form); loss_type chooses its normalisation, one of {', '.join(NORMALISATIONS)}. "
                             f"For TRL's {loss_type!r} objective use algorithm='grpo'.")
        check_choice("importance_sampling_level", importance_sampling_level, ("token", "sequence"))
        self.rho, self.scale_rewards, self.beta = float(rho), scale_rewards, float(beta)
        self.loss_type, self.level = loss_type, importance_sampling_level
        self.off_policy_mask_threshold = off_policy_mask_threshold

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
        shape: StepShape | None = None,  # the step this micro-batch belongs to (normalisation)
        old_logprobs: torch.Tensor | None = None,  # [B, T] log pi_old (before the batch's first pass); None: pi
        entropy_mask: torch.Tensor | None = None,  # [B, T] 0/1: TRL's top_entropy_quantile mask on the loss
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mask.to(logprobs.dtype)
        log_ratio = (logprobs.detach() if old_logprobs is None else old_logprobs) - behavior_logprobs
        ratio = torch.exp(log_ratio)  # [B, T]
        if self.level == "sequence":
            ratio_w = torch.exp(sequence_log_ratio(log_ratio, mask))  # [B, 1]
        else:
            ratio_w = ratio
        weight = ratio_w.clamp(max=self.rho)
        adv = advantages[:, None]
        per_token = -weight * adv * logprobs
        if entropy_mask is not None:
            per_token = per_token * entropy_mask
        metrics = ratio_metrics(ratio, mask, log_ratio)
        if self.off_policy_mask_threshold is not None:
            keep = off_policy_mask(adv, logprobs, behavior_logprobs, mask, self.off_policy_mask_threshold)
            per_token = per_token * keep
            metrics["off_policy_mask/dropped_frac"] = 1.0 - keep.mean().item()
        if ref_logprobs is not None and self.beta != 0:
            kl = reference_kl(logprobs, ref_logprobs)
            per_token = per_token + self.beta * kl
            metrics["kl"] = ((kl.detach() * mask).sum() / mask.sum().clamp(min=1)).item()
        loss = aggregate(per_token, mask, self.loss_type, shape or StepShape.of(mask))
        valid = mask.bool() if ratio_w.shape == mask.shape else (mask.sum(-1, keepdim=True) > 0)
        clipped = (ratio_w > self.rho)[valid]
        metrics["clipped_frac"] = clipped.float().mean().item() if clipped.numel() else 0.0
        return loss, metrics
