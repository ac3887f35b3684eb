"""Metrics reduced over the trainer ranks: sums and maxima, the metrics reward functions log, and the eval_* metrics
of an evaluation during training."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hfllamarl.runtime.loop.rollout import RolloutGroup
from hfllamarl.runtime.training import shared_rewards
from hfllamarl.runtime.world.mesh import data_group, data_world_size


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """Sum a dict of floats over the data (the data-parallel trainer ranks: a tensor-parallel group's ranks hold the
    same data; identity with one)."""
    if data_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=data_group())
    return dict(zip(keys, t.tolist()))


def all_max(values: list[float]) -> list[float]:
    """Element-wise maximum over the trainer world (identity with one trainer rank)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def logged_means(logged: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Metrics reward functions logged with `log_metric` (name -> this rank's sum and count), averaged over every
    call on every trainer rank, as TRL does. Every trainer rank calls it (a name only some ranks logged counts
    theirs)."""
    parts = [logged]
    if data_world_size() > 1:
        parts = [None] * data_world_size()
        dist.all_gather_object(parts, logged, group=data_group())
    totals: dict[str, list[float]] = {}
    for part in parts:
        for name, (total, count) in part.items():
            acc = totals.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += count
    return {name: total / count for name, (total, count) in sorted(totals.items()) if count}


def evaluation_metrics(spec, groups: list[RolloutGroup]) -> dict[str, float]:
    """The eval_* metrics of one evaluation (every trainer rank scores its share with the same reward path as
    training, then the sums are reduced): mean and std of the reward, each function's mean (of a 0/1 reward:
    the accuracy), completion length and truncated share, the policy version and the generation time."""
    rollouts = [r for g in groups for r in g.rollouts]
    local = {"count": 0.0, "scored": 0.0, "reward_sum": 0.0, "reward_sq": 0.0, "len_sum": 0.0, "truncated": 0.0}
    for name in spec.rewards.names:
        local[f"{name}/sum"] = local[f"{name}/n"] = 0.0
    logged: dict[str, tuple[float, int]] = {}
    if rollouts:
        unscored_before = spec.rewards.unscored_count
        rewards, per_func = shared_rewards.score(spec, rollouts, [len(g.rollouts) for g in groups])  # (unscored: NaN)
        spec.rewards.unscored_count = unscored_before  # training's counter; these are eval_reward_unscored
        logged = spec.rewards.drain(len(rollouts))[0]
        scored = [x for x in rewards if not math.isnan(x)]  # unscored (NaN) out of the reward stats, as TRL
        local.update(count=len(rewards), scored=len(scored), reward_sum=sum(scored),
                     reward_sq=sum(x * x for x in scored),
                     len_sum=sum(r.num_sampled for r in rollouts),
                     truncated=sum(r.finish_reason == "length" for r in rollouts))
        for name, scores in per_func.items():
            scored = [x for x in scores if x is not None]
            local[f"{name}/sum"], local[f"{name}/n"] = sum(scored), len(scored)
    total = all_sum(local)
    n, k = max(total["count"], 1.0), max(total["scored"], 1.0)
    mean = total["reward_sum"] / k
    metrics = {"eval_reward": mean, "eval_reward_std": math.sqrt(max(total["reward_sq"] / k - mean * mean, 0.0)),
               "eval_reward_unscored": total["count"] - total["scored"]}
    for name in spec.rewards.names:
        metrics[f"eval_rewards/{name}/mean"] = total[f"{name}/sum"] / max(total[f"{name}/n"], 1.0)
    metrics.update({"eval_completions/mean_length": total["len_sum"] / n,
                    "eval_completions/truncated_frac": total["truncated"] / n, "eval_samples": total["count"],
                    "eval_policy_version": float(groups[0].eval_version),
                    "eval_generation_seconds": groups[0].generation_seconds})
    metrics.update({f"eval_{name}": value for name, value in logged_means(logged).items()})
    return metrics
