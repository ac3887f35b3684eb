"""Rewards scored once per tensor-parallel group.

The ranks of a trainer tensor-parallel group hold the same completions and must train them with the same advantages:
a reward that is not bit-identical between two calls (a grader's time budget, an API judge, a sampled reward, a
random tie-break) would otherwise give the peers different losses, the weights they share would drift apart, and
dynamic sampling could keep different groups on each. So the group's first rank calls the reward functions (as
TRL's one process per batch does: each function is called once per completion) and broadcasts the scores to its
peers as one float64 tensor (unscored: NaN), never as objects; the peers call nothing.
"""

from __future__ import annotations

import math

from hfllamarl.runtime.data.episodes import reward_arguments


def score(spec, rollouts: list, group_sizes: list[int] | None) -> tuple[list[float], dict[str, list[float | None]]]:
    """Every rollout's combined reward and each reward function's scores (`RewardRunner.__call__`), the same on every
    rank of this rank's tensor-parallel group (computed on its first rank, see the module's text)."""
    from hfllamarl.runtime.world.mesh import tp_coordinate, tp_group

    def call():
        return spec.rewards(**reward_arguments(rollouts), trainer_state=spec.trainer_state, group_sizes=group_sizes)

    group = tp_group()
    if group is None:
        return call()
    import torch
    import torch.distributed as dist

    names, n = list(spec.rewards.names), len(rollouts)
    buf = torch.empty(1 + len(names), n, dtype=torch.float64)
    if tp_coordinate() == 0:
        rewards, per_func = call()
        buf[0] = torch.tensor([math.nan if r is None else float(r) for r in rewards], dtype=torch.float64)
        for i, name in enumerate(names, start=1):
            buf[i] = torch.tensor([math.nan if v is None else float(v) for v in per_func[name]], dtype=torch.float64)
    shared = buf.to(spec.device)  # (NCCL broadcasts device tensors; gloo, CPU ones)
    dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
    if tp_coordinate() == 0:
        return rewards, per_func
    rows = shared.cpu().tolist()
    return rows[0], {name: [None if math.isnan(v) else v for v in row] for name, row in zip(names, rows[1:])}
