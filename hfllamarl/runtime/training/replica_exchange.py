"""Trainer replica groups sharing group 0's generators (`trainer_replica_shared_generators`): a share of a global
batch handed from the group that holds it to the group that trains it.

Group 0's generators sample every group's share; group 0's trainer scores them (its reward functions, the groups'
advantages) and, in the step that trains them, hands each participating group its share: one allreduce (a sum) of a
byte buffer over the groups' torchft group, each share in its own slice (`ReplicaGroup.exchange`). A share is plain
JSON: what training needs of each completion (its tokens, behaviour log-probs and versions, finish reason, the mask of
tool-written tokens, its dataset row), its advantage and its reward (logged by the group that trains it). No pickle:
the bytes come from another job.
"""

from __future__ import annotations

import json
import math

import torch

from hfllamarl.runtime.loop.rollout import Rollout

FIELDS = ("prompt_ids", "completion_ids", "behavior_logprobs", "versions", "finish_reason", "completion_text",
          "row_index", "segments", "env_mask")


def encode_share(rollouts: list[Rollout], advantages: torch.Tensor | None, rewards: list[float],
                 offset: int = 0) -> bytes:
    """The bytes of one share: its completions (`FIELDS`), their advantages and rewards, in order. `offset`: the
    holder's (global step - its own policy version): the versions that sampled each token go as global steps."""
    advantages = advantages.tolist() if advantages is not None else [0.0] * len(rollouts)
    if not len(advantages) == len(rewards) == len(rollouts):
        raise ValueError(f"a share of {len(rollouts)} completions with {len(advantages)} advantages and "
                         f"{len(rewards)} rewards")
    rows = [{**{k: getattr(r, k) for k in FIELDS}, "versions": [v + offset for v in r.versions], "advantage": a,
             "reward": None if math.isnan(x) else x} for r, a, x in zip(rollouts, advantages, rewards)]
    return json.dumps(rows, separators=(",", ":")).encode()


def decode_share(data: bytes, offset: int = 0) -> tuple[list[Rollout], torch.Tensor, list[float]]:
    """A share's completions, advantages and rewards (NaN: unscored) from `encode_share`'s bytes, the versions in
    the receiving group's own count (`offset`: its global step - its policy version). A malformed share raises
    ValueError."""
    try:
        rows = json.loads(data.decode())
        for row in rows:
            row["versions"] = [int(v) - offset for v in row["versions"]]
        rollouts = [Rollout(prompt="", columns={}, **{k: row[k] for k in FIELDS}) for row in rows]
        advantages = torch.tensor([float(row["advantage"]) for row in rows], dtype=torch.float32)
        rewards = [math.nan if row["reward"] is None else float(row["reward"]) for row in rows]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a share handed over by another replica group is malformed: {exc}") from None
    return rollouts, advantages, rewards
