"""VCPO's step scaled by the effective sample size (arXiv 2602.17616, part i).

The loss is corrected per sequence, b = min(prod_t pi_old_t/mu_t, clip_max) (sequence-level truncated IS at 8, as
VCPO's recipes), and the optimizer step's learning rate is scaled by how many of the step's N sequences the
importance weights effectively keep:

    w_i = prod_t pi_old_t / mu_t  (untruncated),   rho = ESS / N = (sum_i w_i)^2 / (N sum_i w_i^2)
    lr  = lr_base * sqrt(min(1, rho / base_ratio))         ("linear": without the square root)

over every sequence of the step on every trainer rank; on-policy (all w = 1) the step is the base one. The same step
rule goes on top of any other correction as `off_policy_correction="<name>+ess"` (e.g. "a3po+ess").
"""

from __future__ import annotations

from hfllamarl.corrections import ImportanceSampling, StepScaled


class ESS(StepScaled):
    """`ess`: sequence-level truncated IS and the step scaled by sqrt(ESS/N) (see the module's text). The step rule
    goes on top of any other correction as `off_policy_correction="<name>+ess"`."""

    def __init__(self, clip_max: float = 8.0, rule: str = "sqrt", base_ratio: float = 1.0):
        if not (isinstance(base_ratio, (int, float)) and 0 < base_ratio <= 1):
            raise ValueError(f"ess: base_ratio={base_ratio!r} must be in (0, 1].")
        super().__init__(ImportanceSampling("sequence_truncate", None, clip_max), rule, base_ratio)
