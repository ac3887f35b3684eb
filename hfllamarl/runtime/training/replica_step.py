"""Trainer replica groups: one optimizer step's gradients together with the other groups (`replica_group`).

`replica_gradients` runs on the trainer executor: the step's quorum; the rows this group holds, by share
of the global batch; the step's token count over the groups; with shared generators the shares handed between
groups (`replica_exchange`); the shares no group holds, sampled (`replica_makeup`); forward and backward; the
gradient average and the commit vote, again with the next quorum until a commit succeeds.
"""

from __future__ import annotations

import math

import torch

from hfllamarl.runtime.loop.rollout import Rollout
from hfllamarl.runtime.training.rank_metrics import all_sum
from hfllamarl.runtime.training.replica_exchange import decode_share, encode_share


def replica_gradients(executor, rollouts: list[Rollout], advantages, old: list, sampled_offset: int,
                      shares: list[int] | None = None,
                      rewards: list[float] | None = None) -> tuple[list[Rollout], tuple]:
    """This step's quorum, the gradients of this group's rows averaged over the groups that take part, until a
    commit succeeds (`replica_group`); shares no group holds are sampled and trained too (`replica_makeup`), and
    with shared generators group 0 hands each present group its share (`replica_exchange`). `executor`: the
    trainer's; `shares`: each rollout's share of the global batch (None: this group's own); `rewards`: each one's
    reward (handed over with its share). Returns what stands for the step's rows (empty: no group trained any, no
    optimizer step) and the loss and stats of this group's own."""
    group, spec = executor.spec.replica_group, executor.spec
    while True:
        q = group.begin(executor.version)
        current = rollouts if sampled_offset == group.offset else []  # (sampled under an older offset: lost)
        held = by_share(current, advantages, rewards, shares, group.group)
        local = {}
        for h in range(group.groups):
            local[f"tokens{h}"] = executor._loss_tokens(held[h][0]) if h in held else 0
            local[f"rows{h}"] = len(held[h][0]) if h in held else 0
        local = all_sum(local)  # (over the group's ranks: each may hold a part of a share)
        tokens = {h: local[f"tokens{h}"] for h in range(group.groups) if local[f"rows{h}"] > 0}
        payloads = {h: encode_share(*held[h], offset=group.offset)
                    for h in tokens if h != group.group and h in held}
        total = group.step_tokens(tokens, {h: len(p) for h, p in payloads.items()})
        handed = group.exchange(payloads)  # (this group's own share, from the group that holds it)
        own = [held[h] for h in sorted(held) if group.trains_held(h)] if not group.failed else []
        received = decode_share(handed, group.offset) if handed is not None else None
        if received is not None:
            own.append(received)
        executor.replica_received = received  # (a group without generators logs the rewards of what it trained)
        made, made_advantages, made_tokens = spec.replica_makeup.rows(executor, q.step)  # (shares no group held)
        trained, total = [r for part in own for r in part[0]] + made, total + made_tokens
        trained_advantages = torch.cat([part[1] for part in own if part[1] is not None]
                                       + ([made_advantages] if made_advantages is not None else [])
                                       or [torch.zeros(0)])
        old.clear()  # (pi_old of this attempt's rows: num_iterations is 1 with replica groups)
        result = (executor._accumulate_gradients(trained, trained_advantages, old, step_tokens=total,
                                             groups=group.participants)
                  if trained and not group.failed else (0.0, {}))  # (a failed count: this attempt does not commit)
        group.average(spec.model)
        if group.commit():
            break
        spec.optimizer.zero_grad(set_to_none=True)  # the same rows again, with the next quorum
    n = max(spec.num_generations, 1)
    if rollouts and not current:
        group.discard(len(rollouts) // n)
    # (shared generators, the committed attempt's: shares handed over or received, an away group's share kept)
    group.handed_prompts += sum(len(held[h][0]) // n for h in held if h in group.handed) \
        + (len(received[0]) // n if received is not None else 0)
    group.kept_prompts += sum(len(held[h][0]) // n for h in held if h != group.group and group.trains_held(h))
    executor.trained_rows[-1] = [r.row_index for r in trained[:: spec.num_generations]]
    executor.replica_trained = (trained, trained_advantages)  # (what the group trained in the step: made-up shares too)
    return ((rollouts or trained) if total > 0 else []), result


def by_share(rollouts: list[Rollout], advantages, rewards: list[float] | None, shares: list[int] | None,
             own: int) -> dict[int, tuple]:
    """Rollouts, their advantages and their rewards (`replica_exchange` hands them over with a share) by the share of
    the global batch each belongs to (`shares`; None: all are the group's `own`)."""
    if not rollouts:
        return {}
    shares = shares if shares is not None else [own] * len(rollouts)
    rewards = rewards if rewards is not None else [math.nan] * len(rollouts)
    out = {}
    for h in sorted(set(shares)):
        index = [i for i, s in enumerate(shares) if s == h]
        out[h] = ([rollouts[i] for i in index], advantages[index] if advantages is not None else None,
                  [rewards[i] for i in index])
    return out
