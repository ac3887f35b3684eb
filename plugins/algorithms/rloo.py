"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al., 2024), importance-weighted as AIPO.

Advantage of completion i in a group of G:  A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j).
Loss per token, as AIPO: - min(pi_t / mu_t, rho) * A * log pi_t (no gradient through the weight),
so stale samples are corrected the same way.
"""

from __future__ import annotations

import torch

from .aipo import AIPO


class RLOO(AIPO):
    """The `rloo` algorithm plugin. Args: rho (importance-weight clip, as AIPO)."""

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        if group_size < 2:
            raise ValueError("RLOO needs at least 2 completions per prompt")
        grouped = rewards.view(-1, group_size)  # [B, G]
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - baseline).reshape(-1)
