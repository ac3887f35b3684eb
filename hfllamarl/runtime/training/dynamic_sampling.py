"""Dynamic sampling (DAPO): groups whose rewards are all equal give no learning signal, so they are not trained,
and the step is refilled with groups that do.

With `drop_zero_variance_groups`, the generator samples `dynamic_sampling_extra_prompts` more prompts per step than
the step trains (the next prompts of the data order: `prompts.batch_rows` over the larger batch), and each trainer
rank, once it has scored its share of a batch:

1. drops the groups whose rewards are all equal (their advantage is 0 for every completion);
2. trains, oldest first, its reserve (groups with signal left over from earlier batches) and then this batch's groups
   with signal, up to its share of the step's groups; every trainer rank trains the same number of groups (the
   fewest any rank has, agreed in one all-reduce), so micro-batches match over FSDP2;
3. keeps the groups with signal it could not train in its reserve, for the next step, while their sampled tokens
   stay within `max_staleness` of the policy (a group would be too stale past that: it expires, counted). The
   reserve holds at most one step's share.

Which groups are trained depends only on the samples and their rewards, and the reserve is part of every checkpoint,
so a resume trains exactly what an uninterrupted run trains. When no rank has a group with signal, the step trains
nothing (no optimizer step; the policy version still advances, with the same weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hfllamarl.runtime.loop.rollout import RolloutGroup


@dataclass
class ScoredGroup:
    """A group with its rewards: the combined reward and each function's score, one per completion."""

    group: RolloutGroup
    rewards: list[float]
    per_func: dict[str, list] = field(default_factory=dict)

    @property
    def flat(self) -> bool:
        """All the group's rewards are equal: its advantage is 0 for every completion."""
        return all(math.isclose(r, self.rewards[0], rel_tol=1e-9, abs_tol=1e-12) for r in self.rewards)

    def staleness(self, version: int) -> int:
        """How many policy versions before `version` its oldest sampled token was sampled."""
        return max((version - v for r in self.group.rollouts for v in r.sampled_versions()), default=0)


def split_scored(groups: list[RolloutGroup], rewards: list[float], per_func: dict[str, list]) -> list[ScoredGroup]:
    """The flat per-completion rewards of `groups` (in order), cut back into one `ScoredGroup` per group."""
    out, start = [], 0
    for g in groups:
        end = start + len(g.rollouts)
        out.append(ScoredGroup(g, rewards[start:end], {k: v[start:end] for k, v in per_func.items()}))
        start = end
    return out


def join_scored(scored: list[ScoredGroup]) -> tuple[list[RolloutGroup], list[float], dict[str, list]]:
    """The inverse of `split_scored`: groups, flat rewards and each function's flat scores."""
    names = list(scored[0].per_func) if scored else []
    return ([s.group for s in scored], [x for s in scored for x in s.rewards],
            {k: [x for s in scored for x in s.per_func[k]] for k in names})


class GroupFilter:
    """A trainer rank's side of dynamic sampling: which scored groups it trains at each step (module docstring)."""

    def __init__(self, groups_per_step: int, max_staleness: int):
        self.groups_per_step = groups_per_step  # this rank's share of the step's groups
        self.max_staleness = max_staleness
        self.reserve: list[ScoredGroup] = []  # groups with signal not trained yet, oldest first

    def select(self, scored: list[ScoredGroup], version: int) -> tuple[list[ScoredGroup], dict[str, float]]:
        """The groups to train at the step that starts from policy `version`, and this rank's counts (summed
        over the trainer ranks by the caller): groups scored, flat, trained, left unused (too stale, or past
        the reserve's room) and in reserve."""
        live = [s for s in self.reserve if s.staleness(version) <= self.max_staleness]
        expired = len(self.reserve) - len(live)
        signal = [s for s in scored if not s.flat]
        candidates = live + signal
        n = _fewest(min(self.groups_per_step, len(candidates)))
        train, rest = candidates[:n], candidates[n:]
        # the next step starts from one version later: keep what will still be fresh enough, the newest if too many
        fresh = [s for s in rest if s.staleness(version + 1) <= self.max_staleness]
        self.reserve = fresh[max(0, len(fresh) - self.groups_per_step):]
        unused = expired + len(rest) - len(self.reserve)
        return train, {"dynamic_sampling/scored_groups": float(len(scored)),
                       "dynamic_sampling/flat_groups": float(len(scored) - len(signal)),
                       "dynamic_sampling/trained_groups": float(len(train)),
                       "dynamic_sampling/unused_groups": float(unused),
                       "dynamic_sampling/reserve_groups": float(len(self.reserve))}


def _fewest(n: int) -> int:
    """The smallest `n` over the trainer ranks (every rank calls it at the same point)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
