"""Metrics reduced over the trainer ranks: sums and maxima, a step's logged metrics, the metrics reward functions
log, and the eval_* metrics of an evaluation during training."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hfllamarl.runtime.data.episodes import tool_counts, tool_metrics
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


def step_metrics(spec, groups: list[RolloutGroup], rollouts: list[Rollout], rewards: list[float], per_func: dict,
                 staleness: list[list[int]], loss_total: float, stats: dict) -> dict[str, float]:
    """A step's logged metrics, reduced over the trainer world (`spec`: the trainer's `TrainerSpec`; `staleness`:
    per completion, per token; `stats`: the algorithm's metrics, one value per micro-batch, logged under their own
    names)."""
    n = len(rollouts)
    oldest = [max(s) for s in staleness if s]  # a completion is as stale as its first token
    lengths = [r.num_sampled for r in rollouts]  # as TRL: the tokens the policy sampled, not the tools'
    G = spec.num_generations
    flat = [all(math.isclose(x, rewards[i]) for x in rewards[i:i + G]) for i in range(0, n, G)]
    ended = [length for length, r in zip(lengths, rollouts) if r.finish_reason != "length"]
    partial = [len(r.completion_ids) for r in rollouts if r.segments > 1]
    scored = [x for x in rewards if not math.isnan(x)]  # as TRL's nanmean/nanstd: unscored ones left out
    local = {
        "reward_sum": sum(scored), "reward_sq": sum(x * x for x in scored), "scored": len(scored), "count": n,
        "staleness_sum": sum(oldest), "staleness_n": len(oldest),
        "token_staleness_sum": sum(map(sum, staleness)), "partial": len(partial), "partial_len": sum(partial),
        "len_sum": sum(lengths), "truncated": sum(r.finish_reason == "length" for r in rollouts),
        "empty": sum(length == 0 for length in lengths),
        "groups": len(flat), "flat_groups": sum(flat), "ended": len(ended), "ended_len": sum(ended),
        "tokens": sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts),
    }
    for name, scores in per_func.items():
        vals = [s for s in scores if s is not None]
        local[f"rf_sum/{name}"] = sum(vals)
        local[f"rf_sq/{name}"] = sum(x * x for x in vals)
        local[f"rf_n/{name}"] = len(vals)
    if spec.tools:
        local.update(tool_counts(rollouts))
    summed = all_sum(local)
    extremes = all_max([max(lengths, default=0), -min(lengths, default=1 << 30), max(ended, default=-1),
                        -min(ended, default=1 << 30)])
    count, scored_n = max(summed["count"], 1.0), max(summed["scored"], 1.0)  # (a replica group may have none)
    mean = summed["reward_sum"] / scored_n
    metrics: dict[str, float] = {"reward": mean,
                                 "reward_std": math.sqrt(max(summed["reward_sq"] / scored_n - mean * mean, 0.0))}
    for name in per_func:
        k = max(summed[f"rf_n/{name}"], 1)
        metrics[f"rewards/{name}/mean"] = f_mean = summed[f"rf_sum/{name}"] / k
        metrics[f"rewards/{name}/std"] = math.sqrt(max(summed[f"rf_sq/{name}"] / k - f_mean * f_mean, 0.0))
    metrics["frac_reward_zero_std"] = summed["flat_groups"] / max(summed["groups"], 1)  # TRL's: no signal
    state = spec.trainer_state
    if state is not None and hasattr(state, "num_input_tokens_seen"):  # prompt + completion tokens trained, as TRL
        state.num_input_tokens_seen = int(state.num_input_tokens_seen or 0) + int(summed["tokens"])
        metrics["num_tokens"] = float(state.num_input_tokens_seen)
    # The loss and the algorithm's own metrics (is_ratio/*, clipped_frac, behavior_kl, kl, ...), plus the share of
    # sampled tokens the current policy's top-k/top-p/min-p no longer allow (weight 0; only off-policy).
    metrics.update(reduce_metrics({"loss": [loss_total], "staleness/max": [max(oldest, default=0)], **stats}))
    metrics["staleness/mean"] = summed["staleness_sum"] / max(summed["staleness_n"], 1)
    metrics["staleness/token_mean"] = summed["token_staleness_sum"] / max(summed["len_sum"], 1)
    metrics["partial_rollouts/count"] = summed["partial"]  # completions generated over more than one tick
    metrics["partial_rollouts/mean_length"] = summed["partial_len"] / max(summed["partial"], 1)
    metrics["completions/mean_length"] = summed["len_sum"] / count
    metrics["completions/truncated_frac"] = summed["truncated"] / count
    metrics["completions/empty_frac"] = summed["empty"] / count  # they get a reward, but no token to train
    if spec.tools:
        metrics.update(tool_metrics(summed, count))
    # TRL's names: min/max length, truncated share, lengths of the completions that ended (0 when none did)
    metrics["completions/max_length"] = extremes[0]
    metrics["completions/min_length"] = -extremes[1] if summed["count"] else 0.0
    metrics["completions/clipped_ratio"] = metrics["completions/truncated_frac"]
    any_ended = summed["ended"] > 0
    metrics["completions/mean_terminated_length"] = summed["ended_len"] / summed["ended"] if any_ended else 0.0
    metrics["completions/max_terminated_length"] = extremes[2] if any_ended else 0.0
    metrics["completions/min_terminated_length"] = -extremes[3] if any_ended else 0.0
    # Each replica sampled its share of the batch at once: tokens add up, the slowest replica is the time.
    per_replica = reduce_metrics({f"{g.replica}/{what}/max": [value] for g in groups for what, value in
                                  (("tokens", g.batch_tokens), ("seconds", g.generation_seconds))})
    gen_seconds = max((v for k, v in per_replica.items() if k.endswith("/seconds/max")), default=0.0)
    metrics["generation/seconds"] = gen_seconds
    # The generator side of the last weight sync: its load into the engine (vLLM's reload, or the adapter's).
    metrics["weight_sync/load_seconds"] = max((g.weights_load_seconds for g in groups), default=0.0)
    # The generator processes' CPU time (core-seconds, every thread) over their ticks that closed this batch.
    per_process = {g.replica: g.cpu_seconds for g in groups}
    metrics["generation/cpu_seconds"] = sum(per_process.values())
    # ... and the busiest one's: an engine samples on its own cores (vLLM's CPU kernels cannot take a core lent while
    # it runs: docs/design/performance.md), so a step is at least this long whatever the other cores do
    metrics["generation/busiest_cpu_seconds"] = max(per_process.values(), default=0.0)
    tokens = sum(v for k, v in per_replica.items() if k.endswith("/tokens/max"))
    metrics["generation/tokens_per_s"] = tokens / gen_seconds if gen_seconds > 0 else 0.0
    return metrics


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
