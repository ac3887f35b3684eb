"""Decoupled PPO (AReaL, arXiv 2505.24298) and the plain, coupled PPO it improves on.

Decoupled: the behaviour weight and the trust region refer to two different policies,

    l_t = (pi_prox_t / mu_t) * max(-A c_t, -A clip(c_t, 1 - eps, 1 + eps_high)),   c_t = pi_t / pi_prox_t

where pi_prox is the policy before this step's update (here pi_old, the batch's first-pass log-probs: no extra
forward pass). A token whose weight exceeds `cap` is dropped (AReaL's rejection sampling, "mask" above 5.0) or, with
`action="truncate"`, clipped to it. Every loss in this package has this structure; the plugin is AReaL's defaults.

Coupled (`coupled`): what an asynchronous system gets from plain PPO when it takes the generator's log-probs as
pi_old: c_t = pi_t / mu_t, no behaviour weight. A stale token whose ratio left [1 - eps, 1 + eps_high] gets no
gradient from the clipped side; the study's reference point for "no decoupling".
"""

from __future__ import annotations

import math

import torch

from hfllamarl.corrections import Corrected, log_weight, share


class Decoupled:
    """`decoupled`: b_t = pi_old_t/mu_t, dropped (mask) or clipped (truncate) above `cap`; the anchor is pi_old."""

    rowwise = True  # (each row weighed from its own log-probs: `corrections.rowwise`)
    level = "token"

    def __init__(self, cap: float = 5.0, action: str = "mask"):
        if action not in ("mask", "truncate"):
            raise ValueError(f"decoupled: action={action!r}; choose 'mask' or 'truncate'.")
        if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 1.0):
            raise ValueError(f"decoupled: cap={cap!r} must be a number >= 1.")
        self.cap, self.action = float(cap), action

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        raw = torch.exp(log_weight(old_logprobs, behavior_logprobs, mask))
        over = raw > self.cap
        weight = raw.masked_fill(over, 0.0) if self.action == "mask" else raw.clamp(max=self.cap)
        key = "correction/masked_frac" if self.action == "mask" else "correction/truncated_frac"
        return Corrected(weight, None, share(over, mask), {key: share(over, mask)})


class Coupled:
    """`coupled`: no behaviour weight; the objective's ratio refers to mu (plain PPO on stale samples)."""

    rowwise = True  # (each row weighed from its own log-probs: `corrections.rowwise`)
    level = "token"

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        return Corrected(None, behavior_logprobs.detach(), 0.0, {})
