"""Metrics reduced over the trainer ranks: sums and maxima, the metrics reward functions log, and the eval_* metrics
of an evaluation during training."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hfllamarl.runtime.loop.rollout import Rollout, RolloutGroup
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


def gather_samples(rollouts: list[Rollout], per_func: dict, advantages: torch.Tensor, first: bool,
                   extra: dict[str, list] | None = None) -> dict | None:
    """The step's samples over every trainer rank as TRL's completion-log columns (prompt, completion, one column
    per reward function, advantage, and under "extra" the columns reward functions added with `log_extra`); on
    the first trainer rank, None on the others."""
    local = {"prompt": [r.prompt for r in rollouts], "completion": [r.completion_text for r in rollouts],
             **{name: [math.nan if v is None else v for v in scores] for name, scores in per_func.items()},
             "advantage": advantages.tolist()}
    parts = [(local, extra or {})]
    if data_world_size() > 1:  # (a tensor-parallel group's ranks hold the same samples: one of each)
        parts = [None] * data_world_size()
        dist.all_gather_object(parts, (local, extra or {}), group=data_group())
    if not first:
        return None
    out = {key: [v for part, _ in parts for v in part[key]] for key in local}
    columns = sorted({c for _, more in parts for c in more})  # a column only some ranks logged: None elsewhere
    out["extra"] = {c: [v for part, more in parts for v in more.get(c, [None] * len(part["prompt"]))]
                    for c in columns}
    return out


def reduce_metrics(values: dict[str, list[float]]) -> dict[str, float]:
    """Per-micro-batch metrics -> one value each over this rank's micro-batches and every trainer rank: the
    maximum for names ending in `/max`, the minimum for `/min`, else the mean of the ranks' means. A name only
    some ranks report is reduced over those."""
    local = {k: _combine(k, v) for k, v in values.items() if v}
    if data_world_size() > 1:
        everyone: list = [None] * data_world_size()
        dist.all_gather_object(everyone, local, group=data_group())
    else:
        everyone = [local]
    keys = sorted({k for part in everyone for k in part})
    return {key: _combine(key, [part[key] for part in everyone if key in part]) for key in keys}


def _combine(name: str, values: list[float]) -> float:
    """Several values of metric `name` as one: the maximum for `/max`, the minimum for `/min`, else the mean."""
    if name.endswith("/max"):
        return max(values)
    if name.endswith("/min"):
        return min(values)
    return sum(values) / len(values)
