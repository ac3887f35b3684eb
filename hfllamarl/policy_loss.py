"""TRL's GRPO policy loss with a behaviour-policy correction on top: the one implementation the `aipo` and `grpo`
algorithm plugins configure (they differ in their defaults only).

Three log-probs meet per completion token t: log pi (the current policy, with gradient), log pi_old (the policy
the PPO ratio refers to: the one before this batch's first optimizer step; `old_logprobs`, or log pi detached with
one optimizer step per batch) and log mu (the generator's, which sampled t, maybe several versions stale):

    c_t  = pi_t / pi_old_t                       (token level; GSPO's exp(mean_t log(pi/pi_old)) per sequence)
    l_t  = objective(loss_type, c_t, A)          (`hfllamarl.losses.per_token_objective`; vespo's phi(w))
    l_t *= keep (off-policy mask) * entropy mask
    l_t *= b_t = correction(pi_old / mu)         (constant; truncated or masked per token or sequence; none: 1)
    l_t += beta * KL_t(pi || pi_ref) (* c_t with use_bias_correction_kl)
    loss = normalise(loss_type, l)

The correction b is TRL's vLLM importance-sampling weight; here mu may also be stale, and the same weight corrects
both. For vespo, b enters phi's sequence weight instead of multiplying the loss, as in TRL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hfllamarl.losses import (CLIPPED_LOSS_TYPES, IS_MODES, LOSS_TYPES, StepShape, aggregate, behavior_weight,
                              check_choice, group_advantages, off_policy_mask, per_token_objective, policy_ratio,
                              ratio_metrics, reference_kl, vespo_weight, weight_metrics)

logger = logging.getLogger(__name__)
_warned_uncorrected = False


@dataclass(frozen=True)
class Correction:
    """The behaviour-policy correction b = pi_old/mu: TRL's `vllm_importance_sampling_mode` and its bounds (None:
    no bound on that side)."""

    mode: str
    clip_min: float | None = None
    clip_max: float | None = None

    def __post_init__(self):
        check_choice("vllm_importance_sampling_mode", self.mode, IS_MODES)
        lo, hi = self.clip_min, self.clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"vllm_importance_sampling_clip_min ({lo}) must be below vllm_importance_sampling_clip_max "
                             f"({hi}).")


def warn_uncorrected() -> None:
    """Once per process: training without the correction leaves stale samples uncorrected."""
    global _warned_uncorrected
    if not _warned_uncorrected:
        _warned_uncorrected = True
        logger.warning("vllm_importance_sampling_correction=False: no importance weight pi_old/mu; samples from an "
                       "older policy (or from the generator's kernels) are trained on as if on-policy, which biases "
                       "the gradient as staleness grows.")


@dataclass(frozen=True)
class Objective:
    """TRL's objective settings (each the `GRPOConfig` field of the same name)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))

    @property
    def epsilon_low(self) -> float:
        return float(self.epsilon)

    @property
    def eps_high(self) -> float:
        return float(self.epsilon if self.epsilon_high is None else self.epsilon_high)


class PolicyLoss:
    """An `hfllamarl.contracts.Algorithm`: TRL's objective `objective`, corrected by `correction` (None: off).

    Args:
        objective: the loss_type and its options.
        correction: the behaviour-policy correction, or None.
        scale_rewards: "none", "group" or "batch" (`hfllamarl.losses.group_advantages`).
        beta: the KL coefficient (0: no KL term).
        off_policy_mask_threshold: TRL's off-policy sequence mask (None: off).
        use_bias_correction_kl: multiply the KL term by c, as TRL.
    """

    def __init__(self, objective: Objective, correction: Correction | None, scale_rewards: str = "group",
                 beta: float = 0.0, off_policy_mask_threshold: float | None = None,
                 use_bias_correction_kl: bool = True):
        check_choice("scale_rewards", scale_rewards, ("none", "group", "batch"))
        if objective.loss_type == "vespo" and correction is not None and correction.mode.startswith("sequence"):
            raise ValueError(f"loss_type='vespo' needs a per-token correction (vllm_importance_sampling_mode "
                             f"'token_truncate' or 'token_mask', as TRL requires), not {correction.mode!r}.")
        if correction is None:
            warn_uncorrected()
        self.objective, self.correction = objective, correction
        self.scale_rewards, self.beta = scale_rewards, float(beta)
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.bias_correction_kl = use_bias_correction_kl

    @property
    def loss_type(self) -> str:
        return self.objective.loss_type

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """`[N]` rewards (NaN: unscored) -> `[N]` advantages."""
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None, shape: StepShape | None = None,
             old_logprobs: torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss (see the module's formula) and metrics.

        Args:
            logprobs: `[B, T]` log pi, with gradient.
            behavior_logprobs: `[B, T]` log mu, the generator's.
            advantages: `[B]`.
            mask: `[B, T]` 1 on completion tokens.
            ref_logprobs: `[B, T]` log pi_ref when beta > 0.
            shape: the step's `StepShape` (normalisation).
            old_logprobs: `[B, T]` log pi_old; None: log pi detached (one optimizer step per batch).
            entropy_mask: `[B, T]` 0/1, TRL's top_entropy_quantile mask (None: every token).
        """
        o = self.objective
        mask = mask.to(logprobs.dtype)
        old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
        adv = advantages[:, None]
        coef_1 = policy_ratio(logprobs, old, mask, o.importance_sampling_level)
        weight = None
        if self.correction is not None:
            c = self.correction
            weight = behavior_weight(old, behavior_logprobs, mask, c.mode, c.clip_min, c.clip_max)
        metrics = ratio_metrics(torch.exp(old - behavior_logprobs), mask, old - behavior_logprobs)
        if o.loss_type == "vespo":
            phi = vespo_weight(adv, (logprobs - old).detach(), mask, weight, *o.vespo)
            per_token = -phi * adv * logprobs
            metrics["vespo/phi_seq_mean"] = phi.mean().item()
        else:
            per_token = per_token_objective(o.loss_type, coef_1, adv, logprobs, o.epsilon_low, o.eps_high, o.delta,
                                            o.sapo_temperature_pos, o.sapo_temperature_neg)
        if self.off_policy_mask_threshold is not None:
            keep = off_policy_mask(adv, logprobs, behavior_logprobs, mask, self.off_policy_mask_threshold)
            per_token = per_token * keep
            metrics["off_policy_mask/dropped_frac"] = 1.0 - keep.mean().item()
        if entropy_mask is not None:
            per_token = per_token * entropy_mask.to(per_token.dtype)
        if weight is not None:
            if o.loss_type != "vespo":
                per_token = per_token * weight
            metrics.update(weight_metrics("sampling/importance_sampling_ratio", weight, mask))
        if ref_logprobs is not None and self.beta != 0:
            kl = reference_kl(logprobs, ref_logprobs)
            metrics["kl"] = ((kl.detach() * mask).sum() / mask.sum().clamp(min=1)).item()
            per_token = per_token + self.beta * (kl * coef_1 if self.bias_correction_kl else kl)
        loss = aggregate(per_token, mask, o.loss_type, shape or StepShape.of(mask))
        metrics.update(self._clip_metrics(coef_1.detach(), adv, mask))
        metrics["clipped_frac"] = self._corrected_share(old, behavior_logprobs, mask, weight)
        return loss, metrics

    def _corrected_share(self, old, behavior_logprobs, mask, weight) -> float:
        """The share of tokens (sequences, in a sequence mode) whose weight pi_old/mu the correction bounded
        (truncated or masked): AIPO's clipped_frac."""
        if weight is None:
            return 0.0
        c = self.correction
        raw = behavior_weight(old, behavior_logprobs, mask, c.mode, None, None)  # unbounded: the ratio itself
        bounded = ~torch.isclose(raw, weight) if c.mode.endswith("truncate") else (weight == 0) & (raw != 0)
        valid = mask.bool() if weight.shape == mask.shape else (mask.sum(-1, keepdim=True) > 0)
        values = bounded[valid]
        return values.float().mean().item() if values.numel() else 0.0

    def _clip_metrics(self, coef_1: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """TRL's clip_ratio/* (the share of tokens in a clipped region of PPO's clip) and cispo_clip_ratio."""
        o, valid = self.objective, mask.bool()

        def share(x):
            x = x.expand_as(mask)[valid]
            return x.float().mean().item() if x.numel() else 0.0

        if o.loss_type in CLIPPED_LOSS_TYPES:
            low = (coef_1 < 1 - o.epsilon_low) & (adv < 0)
            high = (coef_1 > 1 + o.eps_high) & (adv > 0)
            return {"clip_ratio/low_mean": share(low), "clip_ratio/high_mean": share(high),
                    "clip_ratio/region_mean": share(low | high)}
        if o.loss_type == "cispo":
            return {"cispo_clip_ratio": share((coef_1 > o.eps_high) & (adv > 0))}
        return {}
