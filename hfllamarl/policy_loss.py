"""TRL's GRPO policy loss with a behaviour-policy correction on top: the one implementation the `aipo` and `grpo`
algorithm plugins configure (they differ in their defaults only).

Three log-probs meet per completion token t: log pi (the current policy, with gradient), log pi_old (the policy
the PPO ratio refers to: the one before this batch's first optimizer step; `old_logprobs`, or log pi detached with
one optimizer step per batch) and log mu (the generator's, which sampled t, maybe several versions stale):

    b_t, anchor_t = correction(pi_old, mu, staleness)   (`hfllamarl.corrections`: b constant, None: 1;
                                                         anchor None: pi_old)
    c_t  = pi_t / anchor_t                       (token level; GSPO's exp(mean_t log(pi/anchor)) per sequence)
    l_t  = objective(loss_type, c_t, A)          (`hfllamarl.losses.per_token_objective`; vespo's phi(w))
    l_t *= trust (the correction's trust-region mask, `+trust`: around the anchor, or around mu with
              `+sampler_trust`) * keep (off-policy mask) * entropy mask
    l_t *= b_t
    l_t += beta * KL_t(pi || pi_ref) (* c_t with use_bias_correction_kl)
    loss = normalise(loss_type, l)

The correction is an `hfllamarl.corrections` plugin: TRL's vLLM importance-sampling weight (here mu may also be
stale, and the same weight corrects both), AIPO's, or one of the corrections made for stale samples. For vespo, b
enters phi's sequence weight instead of multiplying the loss, as in TRL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hfllamarl.corrections import ImportanceSampling, rowwise, share, trust_mask
from hfllamarl.losses import (CLIPPED_LOSS_TYPES, LOSS_TYPES, StepShape, aggregate, check_choice, group_advantages,
                              off_policy_mask, per_token_objective, policy_ratio, ratio_metrics, reference_kl,
                              vespo_weight, weight_metrics)

logger = logging.getLogger(__name__)
_warned_uncorrected = False


def Correction(mode: str, clip_min: float | None = None, clip_max: float | None = None) -> ImportanceSampling:
    """TRL's behaviour-policy correction b = pi_old/mu: `vllm_importance_sampling_mode` and its bounds (None: no
    bound on that side), as a correction (`hfllamarl.corrections.ImportanceSampling`)."""
    return ImportanceSampling(mode, clip_min, clip_max)


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
        correction: the off-policy correction (`hfllamarl.contracts.OffPolicyCorrection`), or None.
        scale_rewards: "none", "group" or "batch" (`hfllamarl.losses.group_advantages`).
        beta: the KL coefficient (0: no KL term).
        off_policy_mask_threshold: TRL's off-policy sequence mask (None: off).
        use_bias_correction_kl: multiply the KL term by c, as TRL.
    """

    def __init__(self, objective: Objective, correction: Correction | None, scale_rewards: str = "group",
                 beta: float = 0.0, off_policy_mask_threshold: float | None = None,
                 use_bias_correction_kl: bool = True):
        check_choice("scale_rewards", scale_rewards, ("none", "group", "batch"))
        if objective.loss_type == "vespo" and getattr(correction, "level", "token") == "sequence":
            raise ValueError(f"loss_type='vespo' needs a per-token correction (vllm_importance_sampling_mode "
                             f"'token_truncate' or 'token_mask', as TRL requires), not {correction!r}.")
        if correction is None:
            warn_uncorrected()
        self.objective, self.correction = objective, correction
        self.scale_rewards, self.beta = scale_rewards, float(beta)
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.bias_correction_kl = use_bias_correction_kl

    @property
    def loss_type(self) -> str:
        return self.objective.loss_type

    @property
    def rows_apart(self) -> bool:
        """Whether a row whose advantage is 0 adds exactly nothing to the step's loss and gradient and changes no
        other row's: a token-normalised objective proportional to the advantage (dapo, cispo), no KL term (beta 0)
        and a correction that weighs each row on its own. The trainer then skips such rows' forward and backward."""
        return self.objective.loss_type in ("dapo", "cispo") and self.beta == 0 and rowwise(self.correction)

    @property
    def flat_rows_inert(self) -> bool:
        """Whether a row whose advantage is 0 sends no gradient to the weights (though its log-probs may enter the
        loss's normaliser, weights and metrics): every objective's per-token term is proportional to the row's
        advantage, with its weights and masks detached, so this holds for all of them without a KL term (beta 0).
        The trainer then runs such rows forward only (`forward_only_plan`)."""
        return self.beta == 0

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """`[N]` rewards (NaN: unscored) -> `[N]` advantages."""
        return group_advantages(rewards, group_size, self.scale_rewards)

    def loss(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None, shape: StepShape | None = None,
             old_logprobs: torch.Tensor | None = None, entropy_mask: torch.Tensor | None = None,
             staleness: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
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
            staleness: `[B, T]` policy versions between each token's sampler and pi_old (for corrections that
                use it, e.g. `a3po`).
        """
        o = self.objective
        mask = mask.to(logprobs.dtype)
        old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
        adv = advantages[:, None]
        corrected = None if self.correction is None else self.correction(old, behavior_logprobs, mask, staleness)
        weight = None if corrected is None else corrected.weight
        anchor = old if corrected is None or corrected.anchor is None else corrected.anchor.to(logprobs.dtype)
        coef_1 = policy_ratio(logprobs, anchor, mask, o.importance_sampling_level)
        metrics = ratio_metrics(torch.exp(old - behavior_logprobs), mask, old - behavior_logprobs)
        if corrected is not None:
            metrics.update(corrected.metrics)
        if o.loss_type == "vespo":
            phi = vespo_weight(adv, (logprobs - anchor).detach(), mask, weight, *o.vespo)
            per_token = -phi * adv * logprobs
            metrics["vespo/phi_seq_mean"] = phi.mean().item()
        else:
            per_token = per_token_objective(o.loss_type, coef_1, adv, logprobs, o.epsilon_low, o.eps_high, o.delta,
                                            o.sapo_temperature_pos, o.sapo_temperature_neg)
        if corrected is not None and corrected.trust is not None:
            reference = corrected.trust_reference
            trust_ratio = coef_1.detach() if reference is None else policy_ratio(
                logprobs.detach(), reference.to(logprobs.dtype), mask, o.importance_sampling_level)
            keep = trust_mask(trust_ratio, adv, *corrected.trust)
            per_token = per_token * keep
            metrics["correction/trust_masked_frac"] = share(keep.expand_as(mask) == 0, mask)
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
        # the share of tokens (sequences, for a sequence weight) whose weight the correction bounded: AIPO's name
        metrics["clipped_frac"] = 0.0 if corrected is None else corrected.bounded
        return loss, metrics

    @property
    def scales_steps(self) -> bool:
        """Whether the correction scales the learning rate of each step (`step_scale`)."""
        return callable(getattr(self.correction, "step_scale", None))

    def step_scale(self, sequence_log_weights: torch.Tensor) -> tuple[float, dict[str, float]] | None:
        """The correction's learning-rate factor for an optimizer step whose sequences have these log(pi_old/mu)
        (`[N]`, every trainer rank's), and its metrics; None when the correction does not scale steps."""
        scale = getattr(self.correction, "step_scale", None)
        return None if scale is None else scale(sequence_log_weights)

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
