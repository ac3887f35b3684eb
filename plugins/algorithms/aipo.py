"""AIPO: asynchronous importance-weighted policy optimisation (LlamaRL, arXiv 2505.24034, section 5), as a
staleness correction on top of TRL's objectives.

The objective is TRL's `loss_type` (default "dapo") with the PPO ratio c = pi/pi_old, exactly as `GRPOTrainer`;
the correction for the behaviour policy mu is AIPO's truncated importance weight, a constant per token:

    b_t = min(pi_old_t / mu_t, aipo_rho)          (TRL's token_truncate with clip_max = aipo_rho, no lower bound)
    l_t = objective(loss_type, c_t, A) * b_t

With one optimizer step per batch (pi_old = pi before the step, c = 1 in value) and the default loss_type, the
gradient is the paper's, - min(pi/mu, rho) * A * grad log pi: a token whose weight is truncated still learns with
weight rho (the clip bounds the variance, it does not stop the token). The logged loss is TRL's value.

TRL's correction fields: leaving `vllm_importance_sampling_mode`, `_clip_min` and `_clip_max` at TRL's defaults
("sequence_mask", None, 3.0) means AIPO's truncation at aipo_rho. Setting any of them to something else selects
TRL's correction exactly as TRL reads those three fields; aipo_rho must then stay at its default (4.0) or equal
clip_max with mode "token_truncate" (the same correction), else the settings contradict and are refused.
`vllm_importance_sampling_correction=False` trains without any correction (aipo_rho must then stay at its default).

`off_policy_correction` names another correction (`hfllamarl.corrections`, options in `off_policy_correction_kwargs`)
instead of the one those fields describe ("trl", the default when the plugin is built directly; a config's "auto"
resolves it by the job's staleness, `hfllamarl.corrections.resolve`).
"""

from __future__ import annotations

from hfllamarl import corrections
from hfllamarl.corrections import ImportanceSampling
from hfllamarl.policy_loss import Correction, Objective, PolicyLoss

DEFAULT_RHO = 4.0
TRL_CORRECTION_DEFAULTS = ("sequence_mask", None, 3.0)  # GRPOConfig's mode, clip_min, clip_max


def aipo_correction(rho: float, enabled: bool, mode: str, clip_min: float | None,
                    clip_max: float | None) -> ImportanceSampling | None:
    """The correction `aipo` applies for these settings (see the module docstring), or a ValueError saying which
    settings contradict."""
    if rho < 1.0:
        raise ValueError(f"AIPO: rho={rho} must be >= 1")
    rho_set = rho != DEFAULT_RHO
    if not enabled:
        if rho_set:
            raise ValueError(f"aipo_rho={rho} bounds the importance weight, but vllm_importance_sampling_correction="
                             "False turns the weight off: remove one of them.")
        return None
    if (mode, clip_min, clip_max) == TRL_CORRECTION_DEFAULTS:
        return Correction("token_truncate", None, float(rho))
    if rho_set and not (mode == "token_truncate" and clip_max == rho):
        raise ValueError(f"aipo_rho={rho} and vllm_importance_sampling_mode={mode!r} (clip_min={clip_min}, "
                         f"clip_max={clip_max}) are two different corrections. aipo_rho is AIPO's token_truncate at "
                         "clip_max=aipo_rho: keep aipo_rho and leave the vllm_importance_sampling_* fields unset, or "
                         "set those and leave aipo_rho unset (or equal to clip_max with mode 'token_truncate').")
    return Correction(mode, clip_min, clip_max)


class AIPO(PolicyLoss):
    """The `aipo` algorithm plugin (the maths: `hfllamarl.policy_loss.PolicyLoss`).

    Args:
        rho: upper bound of the weight pi_old/mu (paper: 2..10; config `aipo_rho`).
        scale_rewards: "none" (default, the paper's advantage r - mean), "group" or "batch".
        The other options are the `GRPOConfig` fields of the same name, with TRL's defaults.
    """

    def __init__(self, rho: float = DEFAULT_RHO, scale_rewards: str = "none", beta: float = 0.0,
                 loss_type: str = "dapo", importance_sampling_level: str = "token",
                 off_policy_mask_threshold: float | None = None, epsilon: float = 0.2,
                 epsilon_high: float | None = None, delta: float | None = None,
                 vllm_importance_sampling_correction: bool = True,
                 vllm_importance_sampling_mode: str = "sequence_mask",
                 vllm_importance_sampling_clip_min: float | None = None,
                 vllm_importance_sampling_clip_max: float | None = 3.0,
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                 vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
                 vespo_lambda_neg: float = 2.0, use_bias_correction_kl: bool = True,
                 off_policy_correction: str = "trl", off_policy_correction_kwargs: dict | None = None):
        self.rho = float(rho)
        trl = aipo_correction(self.rho, vllm_importance_sampling_correction, vllm_importance_sampling_mode,
                              vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max)
        trl_set = not vllm_importance_sampling_correction or (
            vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max) != TRL_CORRECTION_DEFAULTS
        rho_set = rho != DEFAULT_RHO and off_policy_correction != "aipo"  # (the "aipo" correction takes aipo_rho)
        correction = corrections.build(off_policy_correction, off_policy_correction_kwargs, trl, trl_set or rho_set,
                                       rho=self.rho)
        objective = Objective(loss_type, importance_sampling_level, float(epsilon), epsilon_high,
                              None if delta is None else float(delta), float(sapo_temperature_pos),
                              float(sapo_temperature_neg),
                              (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg))
        super().__init__(objective, correction, scale_rewards, beta, off_policy_mask_threshold,
                         use_bias_correction_kl)
