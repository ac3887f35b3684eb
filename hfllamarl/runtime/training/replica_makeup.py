"""Trainer replica groups: a share of a global batch that no group holds is sampled and trained anyway.

Each group's generators sample its share of global batch k ahead of the step that trains it. When the step comes a
share can be missing: its group is away (lost, frozen, restarting, not up yet), or it takes part but holds nothing
current (what its generators sampled before it healed was keyed by older global steps). The step's first count
over the participants (`ReplicaGroup.step_tokens`) tells each of them which shares are missing and who samples each
(`ReplicaGroup.makes_up`: its own group when that one takes part, else the participants in turn); that group samples
the share now, on its trainer ranks with the policy it is about to step (as a bootstrapped batch: the same prompts,
sampling distribution and recorded behaviour log-probs, `bootstrap.BootstrapSampler`, on-policy), scores it with the
job's reward functions and trains it in the same step. So every global step trains every prompt of its batch once,
whichever groups are up; what a lost group held in flight is sampled again, not skipped.

It costs the trainer's own decoding (transformers, KV cache) while a share is missing, in the steps a group is away
or catching up. Where the trainer cannot sample as the generator would (`blocker`) the share is left out, as it is
without this, and that is logged once.
"""

from __future__ import annotations

import logging

import torch

from hfllamarl.runtime.data.prompts import group_batch_rows
from hfllamarl.runtime.loop.rollout import RolloutGroup
from hfllamarl.runtime.loop.schedule import trainer_positions
from hfllamarl.runtime.training.bootstrap import cannot_sample
from hfllamarl.runtime.training.rank_metrics import all_sum

logger = logging.getLogger("hfllamarl")


def blocker(spec) -> str | None:
    """Why the trainer cannot sample a missing share as the generators would (None: it can). `spec`: the job's
    `GeneratorSpec`."""
    return "; ".join(cannot_sample(spec)) or None


class ShareMakeup:
    """Samples the shares of a global batch this group makes up (see the module's text).

    Args:
        sampler: the trainer's `BootstrapSampler` (its model, tokenizer, dataset and the generators' spec), or None
            where it cannot sample (`why_not`).
        data_parallel_size, data_rank: this trainer rank's place among its group's data-parallel ranks: it trains
            its positions of a share (`trainer_positions`), as it would of a batch its generators sampled.
    """

    def __init__(self, sampler, data_parallel_size: int, data_rank: int, why_not: str | None = None):
        self.sampler, self.why_not = sampler, why_not
        self.data_parallel_size, self.data_rank = data_parallel_size, data_rank
        self._kept: dict[tuple[int, int, int], list[RolloutGroup] | None] = {}  # (global batch, share, version)
        self._last: dict[int, int] = {}  # share -> the last global batch it was made up in (one log a stretch)
        self._told = False

    def rows(self, executor, global_batch: int) -> tuple[list, torch.Tensor | None, float]:
        """After the step's count (`ReplicaGroup.step_tokens`) of global batch `global_batch`: the rollouts this
        trainer rank trains for the missing shares dealt to its group (`ReplicaGroup.makes_up`), scored by the job's
        reward functions, their advantages (None: none), and their loss tokens over every participant (0 when no
        share is missing: then no group counts)."""
        group, spec = executor.spec.replica_group, executor.spec
        if not group.missing:
            return [], None, 0.0
        made = [r for share in group.makes_up() for g in self.sample(group, share, global_batch, executor.version)
                for r in g.rollouts]
        advantages = None
        if made:
            rewards, per_func = executor._score(made, [spec.num_generations] * (len(made) // spec.num_generations))
            spec.rewards.drain(len(made))  # (what reward functions log belongs to the step's own batch)
            advantages = executor._advantages(rewards, per_func)
        return made, advantages, group.more_tokens(all_sum({"tokens": executor._loss_tokens(made)})["tokens"])

    def sample(self, group, share: int, global_batch: int, version: int) -> list[RolloutGroup]:
        """This rank's groups of `group`'s (a `ReplicaGroup`) share `share` of global batch `global_batch`, sampled
        by the policy at `version` (the same ones again when a failed attempt of the step asks twice); none when
        this trainer cannot sample it (logged once). Every rank of the group samples the whole share alike (same
        prompts, same random stream: the sharded forward passes stay in step) and keeps its own positions."""
        key = (global_batch, share, version)
        if key not in self._kept:
            self._kept = {k: v for k, v in self._kept.items() if k[0] == global_batch}  # (older steps: done)
            self._kept[key] = self._sampled(group, share, global_batch, version)
        groups = self._kept[key]
        if groups is None:
            return []
        mine = set(trainer_positions(len(groups), self.data_parallel_size, self.data_rank))
        return [g for g in groups if g.position in mine]

    def _sampled(self, group, share: int, global_batch: int, version: int) -> list[RolloutGroup] | None:
        spec = self.sampler.spec if self.sampler is not None else None
        if spec is not None:
            rows = group_batch_rows(len(self.sampler.dataset), spec.prompts_per_batch, global_batch, spec.seed,
                                    spec.shuffle, share, group.groups)
            seed = (spec.seed * 1_000_003 + global_batch) * 1_009 + share + 1  # (not a bootstrapped batch's stream)
            groups = self.sampler.sample_rows(rows, global_batch, version, seed)
            if groups is not None:
                group.made_up += len(groups)
                if group.is_main and self._last.get(share, -2) < global_batch - 1:
                    logger.warning("trainer replica group %d: from global step %d, samples the share of group %d "
                                   "itself while it is missing (%s)", group.group, global_batch + 1, share,
                                   _why_missing(group, share))
                self._last[share] = global_batch
                return groups
            why = "a prompt of it leaves no room for a whole completion within max_model_len"
        else:
            why = self.why_not
        if group.is_main and not self._told:
            self._told = True
            logger.warning("trainer replica group %d: the share of group %d of global step %d is missing and not "
                           "trained (the trainer cannot sample it: %s); logged once", group.group, share,
                           global_batch + 1, why)
        return None


def _why_missing(group, share: int) -> str:
    """Why share `share` is missing from the step (logged when a group starts to sample it itself)."""
    if group.shared_generators and share != 0:  # (group 0's generators sample every share)
        return ("group 0's generators, which sample it, hold nothing current" if 0 in group.members
                else "group 0, whose generators sample it, is away")
    return "that group holds nothing current for it" if share in group.members else "that group is away"
