"""M2PO (arXiv 2510.01161): second-moment masking instead of a bound on each weight.

With l_t = log(pi_old_t / mu_t) over the micro-batch's completion tokens, M2 = mean_t l_t^2. While M2 over the
tokens kept exceeds tau (0.04), the token with the largest l_t^2 is dropped (as AReaL: the fewest largest tokens
such that the mean of the rest is below tau; at least one token is kept). Kept tokens get the whole weight
b_t = pi_old_t/mu_t, untruncated: the bound on the second moment is what limits the variance, so a batch whose
policies agree loses nothing, and only a stale batch loses its most off-policy tokens. Dropped tokens stay in the
loss's normaliser (as TRL's masks).
"""

from __future__ import annotations

import math

import torch

from hfllamarl.corrections import Corrected, log_weight, share


def second_moment_mask(log_w: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """`[B, T]` 1 on the completion tokens kept: all of them when mean(l^2) <= tau, else all but the k largest
    l^2, k the fewest with mean(l^2) of the rest below tau (at least one kept)."""
    valid = mask.bool()
    squares = (log_w ** 2)[valid]
    keep = valid.clone()
    n = squares.numel()
    if not n or float(squares.mean()) <= tau:
        return keep.to(mask.dtype)
    order = torch.argsort(squares, descending=True)
    ranked = squares[order].double()
    tail_sums = ranked.flip(0).cumsum(0).flip(0)  # tail_sums[k]: sum of the squares from rank k on
    counts = torch.arange(n, 0, -1, dtype=torch.float64)
    ok = (tail_sums / counts) < tau
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else n - 1  # drop the k largest
    dropped = torch.zeros(n, dtype=torch.bool)
    dropped[order[:k]] = True
    flat = keep[valid].clone()
    flat[dropped] = False
    keep[valid] = flat
    return keep.to(mask.dtype)


class M2PO:
    """`m2po`: drop the most off-policy tokens until the batch's second moment of log(pi_old/mu) is below tau."""

    level = "token"

    def __init__(self, tau: float = 0.04):
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"m2po: tau={tau!r} must be a positive number.")
        self.tau = float(tau)

    def __call__(self, old_logprobs, behavior_logprobs, mask, staleness=None) -> Corrected:
        log_w = log_weight(old_logprobs, behavior_logprobs, mask)
        keep = second_moment_mask(log_w, mask, self.tau)
        dropped = mask.bool() & ~keep.bool()
        m2 = float(((log_w ** 2) * mask).sum() / mask.sum().clamp(min=1))
        return Corrected(torch.exp(log_w) * keep, None, share(dropped, mask),
                         {"correction/masked_frac": share(dropped, mask), "correction/m2": m2})
