"""GRPO as TRL's `GRPOTrainer` computes it, with every loss switch of TRL 1.16 (`loss_type`, GSPO's
`importance_sampling_level`, `epsilon`/`epsilon_high`/`delta`, SAPO's temperatures, VESPO's gamma weights, the vLLM
importance-sampling correction and its modes, the off-policy sequence mask, `use_bias_correction_kl`) and TRL's
defaults (scale_rewards="group", the correction in "sequence_mask" mode at 3.0).

The maths is `hfllamarl.policy_loss.PolicyLoss`, shared with `aipo` (which differs in its defaults only): the
objective of `loss_type` with the PPO ratio c = pi/pi_old, times the behaviour-policy weight pi_old/mu. In TRL that
weight corrects vLLM's kernel mismatch; here mu may also be several policy versions old, and the same weight corrects
both. With `vllm_importance_sampling_correction=False` there is no weight (biased when samples are stale).
`off_policy_correction` names another correction instead (`hfllamarl.corrections`; "trl": the fields' own).
"""

from __future__ import annotations

from hfllamarl import corrections
from hfllamarl.policy_loss import Correction, Objective, PolicyLoss

TRL_CORRECTION_DEFAULTS = (True, "sequence_mask", None, 3.0)  # GRPOConfig's correction, mode, clip_min, clip_max


class GRPO(PolicyLoss):
    """The `grpo` algorithm plugin; every option is the `GRPOConfig` field of the same name (TRL's defaults)."""

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None, scale_rewards: str = "group",
                 delta: float | None = None, beta: float = 0.0, loss_type: str = "dapo",
                 importance_sampling_level: str = "token", off_policy_mask_threshold: float | None = None,
                 vllm_importance_sampling_correction: bool = True,
                 vllm_importance_sampling_mode: str = "sequence_mask",
                 vllm_importance_sampling_clip_min: float | None = None,
                 vllm_importance_sampling_clip_max: float | None = 3.0,
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                 vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
                 vespo_lambda_neg: float = 2.0, use_bias_correction_kl: bool = True,
                 off_policy_correction: str = "trl", off_policy_correction_kwargs: dict | None = None):
        objective = Objective(loss_type, importance_sampling_level, float(epsilon), epsilon_high,
                              None if delta is None else float(delta), float(sapo_temperature_pos),
                              float(sapo_temperature_neg),
                              (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg))
        trl = Correction(vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
                         vllm_importance_sampling_clip_max) if vllm_importance_sampling_correction else None
        fields_set = (vllm_importance_sampling_correction, vllm_importance_sampling_mode,
                      vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max) != TRL_CORRECTION_DEFAULTS
        correction = corrections.build(off_policy_correction, off_policy_correction_kwargs, trl, fields_set)
        super().__init__(objective, correction, scale_rewards, beta, off_policy_mask_threshold,
                         use_bias_correction_kl)
