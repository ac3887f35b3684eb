"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al., 2024), importance-weighted as AIPO.

Advantage of completion i in a group of G:  A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j).
The loss and its correction are AIPO's (`aipo.AIPO`). An unscored completion (NaN reward) is no one's baseline and
gets advantage 0, as is one whose group has no other scored completion.
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
        others = (~torch.isnan(grouped)).sum(dim=1, keepdim=True) - 1  # scored completions besides each one
        baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / others.clamp(min=1)
        adv = torch.where(others > 0, grouped - baseline, torch.zeros_like(grouped))
        return torch.nan_to_num(adv, nan=0.0).reshape(-1)
