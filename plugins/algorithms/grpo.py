"""GRPO as TRL's `GRPOTrainer` computes it, with every loss switch of TRL 1.16 (`loss_type`, GSPO's
`importance_sampling_level`, `epsilon`/`epsilon_high`/`delta`, SAPO's temperatures, the vLLM importance-sampling
correction and its modes, the off-policy sequence mask, `use_bias_correction_kl`).

Per completion token t with advantage A, TRL's decomposition (trl/trainer/grpo_trainer.py, `_compute_loss`):

    c_t   = pi_t / pi_old_t                        # the PPO ratio (token, or GSPO's per sequence)
    l_t   = objective(loss_type, c_t, A)            # PPO's double clip, CISPO or SAPO
    l_t  *= w_t                                     # the importance weight pi_old / mu, truncated or masked
    l_t  *= keep (off-policy mask); + beta * KL_t (* c_t)
    loss  = normalise(loss_type, l)

Each batch is trained on with one optimizer step, so pi_old is the current policy before the step (log pi
detached), as in TRL with num_iterations=1: c_t is 1 in value (its gradient is grad log pi), and the clip
regions of epsilon/epsilon_high/delta are never entered (`clip_ratio/*` read 0), exactly as in TRL at that
setting. What corrects for the generator's staleness here is the weight w = pi_old/mu: in TRL it corrects vLLM's
kernel mismatch; here mu may also be several policy versions old, and the same weight corrects both. With
`vllm_importance_sampling_correction=False` there is no weight (biased when samples are stale).
"""

from __future__ import annotations

import torch

from hfllamarl.losses import (CLIPPED_LOSS_TYPES, IS_MODES, StepShape, aggregate, behavior_weight, check_choice,
                              group_advantages, off_policy_mask, per_token_objective, policy_ratio, ratio_metrics,
                              reference_kl, weight_metrics)


class GRPO:
    """The `grpo` algorithm plugin; every option is the `GRPOConfig` field of the same name (TRL's defaults)."""

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None, scale_rewards: str = "group",
                 delta: float | None = None, beta: float = 0.0, loss_type: str = "dapo",
                 importance_sampling_level: str = "token", off_policy_mask_threshold: float | None = None,
                 vllm_importance_sampling_correction: bool = True,
                 vllm_importance_sampling_mode: str = "sequence_mask",
                 vllm_importance_sampling_clip_min: float | None = None,
                 vllm_importance_sampling_clip_max: float | None = 3.0,
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                 use_bias_correction_kl: bool = True):
        if loss_type == "vespo":
            raise ValueError("loss_type='vespo' is not supported: its gamma weights need TRL's per-sequence importance "
                             "ratios of the generation step; choose grpo, bnpo, dr_grpo, dapo, cispo, sapo or luspo.")
        per_token_objective(loss_type, torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1))  # checks loss_type
        check_choice("importance_sampling_level", importance_sampling_level, ("token", "sequence"))
        check_choice("vllm_importance_sampling_mode", vllm_importance_sampling_mode, IS_MODES)
        lo, hi = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"vllm_importance_sampling_clip_min ({lo}) must be below vllm_importance_sampling_clip_max "
                             f"({hi}).")
        self.epsilon_low = float(epsilon)
        self.epsilon_high = float(epsilon_high) if epsilon_high is not None else self.epsilon_low
        self.delta = None if delta is None else float(delta)
        self.scale_rewards, self.beta = scale_rewards, float(beta)
        self.loss_type, self.level = loss_type, importance_sampling_level
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.correction, self.mode, self.clip = vllm_importance_sampling_correction, vllm_importance_sampling_mode, (lo, hi)
        self.sapo = (float(sapo_temperature_pos), float(sapo_temperature_neg))
        self.bias_correction_kl = use_bias_correction_kl

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs, behavior_logprobs, advantages, mask, ref_logprobs=None, shape: StepShape | None = None):
        mask = mask.to(logprobs.dtype)
        old = logprobs.detach()  # pi_old: the policy before this step's optimizer step
        adv = advantages[:, None]
        coef_1 = policy_ratio(logprobs, old, mask, self.level)
        per_token = per_token_objective(self.loss_type, coef_1, adv, logprobs, self.epsilon_low, self.epsilon_high,
                                        self.delta, *self.sapo)
        metrics = ratio_metrics(torch.exp(old - behavior_logprobs), mask, old - behavior_logprobs)
        if self.off_policy_mask_threshold is not None:
            keep = off_policy_mask(adv, logprobs, behavior_logprobs, mask, self.off_policy_mask_threshold)
            per_token = per_token * keep
            metrics["off_policy_mask/dropped_frac"] = 1.0 - keep.mean().item()
        if self.correction:
            weight = behavior_weight(old, behavior_logprobs, mask, self.mode, *self.clip)
            per_token = per_token * weight
            metrics.update(weight_metrics("sampling/importance_sampling_ratio", weight, mask))
        if ref_logprobs is not None and self.beta != 0:
            kl = reference_kl(logprobs, ref_logprobs)
            metrics["kl"] = ((kl.detach() * mask).sum() / mask.sum().clamp(min=1)).item()
            per_token = per_token + self.beta * (kl * coef_1 if self.bias_correction_kl else kl)
        loss = aggregate(per_token, mask, self.loss_type, shape or StepShape.of(mask))
        metrics.update(self._clip_metrics(coef_1.detach(), adv, mask))
        return loss, metrics

    def _clip_metrics(self, coef_1: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """TRL's clip_ratio/* (the share of tokens in a clipped region), and clipped_frac (any region)."""
        coef_1 = coef_1.expand_as(mask)
        valid = mask.bool()

        def share(x):
            x = x.expand_as(mask)[valid]
            return x.float().mean().item() if x.numel() else 0.0

        if self.loss_type in CLIPPED_LOSS_TYPES:
            low = (coef_1 < 1 - self.epsilon_low) & (adv < 0)
            high = (coef_1 > 1 + self.epsilon_high) & (adv > 0)
            out = {"clip_ratio/low_mean": share(low), "clip_ratio/high_mean": share(high),
                   "clip_ratio/region_mean": share(low | high)}
            out["clipped_frac"] = out["clip_ratio/region_mean"]
            return out
        if self.loss_type == "cispo":
            clipped = share((coef_1 > self.epsilon_high) & (adv > 0))
            return {"cispo_clip_ratio": clipped, "clipped_frac": clipped}
        return {"clipped_frac": 0.0}
