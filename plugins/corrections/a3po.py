"""A-3PO (arXiv 2512.06547): decoupled PPO with the proximal policy interpolated instead of recomputed.

For a token sampled d = staleness policy versions ago (behaviour version v_b, current v, proximal v - 1):

    alpha_t      = clamp((d_t - 1) / d_t, 0, 1)          (0 when d <= 1: the proximal policy is mu)
    log pi_prox  = log mu + alpha_t * (log pi_old - log mu)
    b_t          = pi_prox_t / mu_t = (pi_old_t / mu_t) ** alpha_t      (dropped above `cap`, AReaL's 5.0)
    c_t          = pi_t / pi_prox_t                                       (the trust region's ratio)

as AReaL's `prox_logp_method="loglinear"`. The behaviour weight is tempered (a power alpha < 1 of pi_old/mu), and
the trust region is centred between mu and the current policy, nearer the current one the staler the token.

`lag` (the paper: 1) puts the proximal policy `lag` versions behind the current one, alpha = clamp((d - lag) / d, 0,
1): the trust region then spans `lag` versions (a token at most `lag` versions stale is clipped against mu itself,
as plain PPO).
"""

from __future__ import annotations

import math

import torch

from hfllamarl.corrections import Corrected, log_weight, share


class A3PO:
    """`a3po`: the interpolated proximal policy (see the module's text); needs each token's staleness."""

    rowwise = True  # (each row weighed from its own log-probs: `corrections.rowwise`)
    level = "token"

    def __init__(self, cap: float = 5.0, lag: float = 1.0):
        if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 1.0):
            raise ValueError(f"a3po: cap={cap!r} must be a number >= 1.")
        if not (isinstance(lag, (int, float)) and math.isfinite(lag) and lag >= 1.0):
            raise ValueError(f"a3po: lag={lag!r} must be a number of versions >= 1.")
        self.cap, self.lag = float(cap), float(lag)

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        if staleness is None:
            raise ValueError("a3po needs each token's staleness (the trainer passes it to a loss that names "
                             "`staleness`)")
        d = staleness.to(old_logprobs.dtype)
        alpha = torch.where(d > self.lag, (d - self.lag) / d.clamp(min=1), torch.zeros_like(d)) * mask
        log_b = alpha * log_weight(old_logprobs, behavior_logprobs, mask)
        weight = torch.exp(log_b)
        over = weight > self.cap
        anchor = (behavior_logprobs + log_b).detach()  # log pi_prox
        metrics = {"correction/masked_frac": share(over, mask),
                   "correction/alpha_mean": float((alpha * mask).sum() / mask.sum().clamp(min=1))}
        return Corrected(weight.masked_fill(over, 0.0), anchor, share(over, mask), metrics)
