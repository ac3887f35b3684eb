"""TRL's four importance-sampling corrections and AIPO's, as correction plugins.

TRL (`vllm_importance_sampling_mode`): b = pi_old/mu per token (`token_*`) or its product over the sequence
(`sequence_*`), truncated into [clip_min, clip_max] (`*_truncate`) or set to 0 outside (`*_mask`); TRL's bounds
are None and 3.0. AIPO (LlamaRL, section 5): b = min(pi_old/mu, rho) per token, rho = 4 (the paper: 2..10). The
objective's ratio refers to pi_old in all five.
"""

from __future__ import annotations

from hfllamarl.corrections import ImportanceSampling


class TokenTruncate(ImportanceSampling):
    """`token_truncate`: b_t = clip(pi_old_t/mu_t, clip_min, clip_max)."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = 3.0):
        super().__init__("token_truncate", clip_min, clip_max)


class TokenMask(ImportanceSampling):
    """`token_mask`: b_t = pi_old_t/mu_t inside [clip_min, clip_max], else 0."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = 3.0):
        super().__init__("token_mask", clip_min, clip_max)


class SequenceTruncate(ImportanceSampling):
    """`sequence_truncate`: b = clip(prod_t pi_old_t/mu_t, clip_min, clip_max) for every token of the sequence."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = 3.0):
        super().__init__("sequence_truncate", clip_min, clip_max)


class SequenceMask(ImportanceSampling):
    """`sequence_mask`: b = prod_t pi_old_t/mu_t inside [clip_min, clip_max], else 0 (TRL's default)."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = 3.0):
        super().__init__("sequence_mask", clip_min, clip_max)


class AIPOTruncate(ImportanceSampling):
    """`aipo`: b_t = min(pi_old_t/mu_t, rho), no lower bound (token_truncate at clip_max = rho)."""

    def __init__(self, rho: float = 4.0):
        if not rho >= 1.0:
            raise ValueError(f"AIPO: rho={rho} must be >= 1 (a bound below 1 would down-weight on-policy tokens)")
        super().__init__("token_truncate", None, float(rho))
