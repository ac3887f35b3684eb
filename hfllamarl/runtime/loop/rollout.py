"""What crosses the `rollouts` channel: sampled completions with their behaviour log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


ROLLOUTS = "rollouts"  # the channel that carries rollout groups from the generator replicas to the trainer ranks
UNFINISHED = ""


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    `behavior_logprobs[t]` is log mu of `completion_ids[t]` under the policy version
    `versions[t]` that sampled it (a partial rollout resumed under new weights spans versions).
    `segments` counts the ticks it was generated in (1 unless it was a partial rollout); while the
    generator still carries it, `finish_reason` is `UNFINISHED`.

    `env_mask[t]` (TRL's name) is 1 for a token the policy sampled and 0 for a token the environment wrote
    into the completion (tool results and the turn openings around them): those are context, never trained,
    and their log-prob (0.0) and version are placeholders. None: every token was sampled.
    """

    prompt: Any  # the dataset row's `prompt`: a string or a list of chat messages
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" or "length" (UNFINISHED while a partial rollout is carried)
    completion_text: str
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions
    row_index: int = -1  # index of the prompt's row in the training dataset
    segments: int = 1  # ticks (generation calls) the completion was sampled in
    model_rewards: dict[str, float] = field(default_factory=dict)  # reward models' scores, from the generator
    env_mask: list[int] | None = None  # 1: sampled by the policy (trained), 0: written by a tool (context only)
    episode: Any = None  # multi-turn rollouts: `hfllamarl.runtime.agents.multi_turn.Episode` (messages, tool counts, ...)

    def __post_init__(self):
        if not (len(self.completion_ids) == len(self.behavior_logprobs) == len(self.versions)):
            raise ValueError("a rollout needs one behaviour log-prob and one version per completion token")
        if self.env_mask is not None and len(self.env_mask) != len(self.completion_ids):
            raise ValueError("a rollout's env_mask needs one 0/1 per completion token")

    def append_sampled(self, comp, version: int) -> int:
        """Append the tokens of one vLLM completion segment `comp`, each with its sampled log-prob and `version`
        (and a 1 in `env_mask` when the rollout keeps one); returns how many."""
        ids = list(comp.token_ids)
        logprobs = sampled_logprobs(comp.logprobs, ids)
        self.completion_ids += ids
        self.behavior_logprobs += logprobs
        self.versions += [version] * len(ids)
        if self.env_mask is not None:
            self.env_mask += [1] * len(ids)
        return len(ids)

    @property
    def sampled(self) -> list[int]:
        """Positions of the completion tokens the policy sampled (all but the tool/environment tokens)."""
        if self.env_mask is None:
            return list(range(len(self.completion_ids)))
        return [t for t, m in enumerate(self.env_mask) if m]

    @property
    def num_sampled(self) -> int:
        return len(self.completion_ids) if self.env_mask is None else sum(1 for m in self.env_mask if m)

    def sampled_versions(self) -> list[int]:
        """The policy version of every sampled token (staleness is a property of sampled tokens only)."""
        if self.env_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.env_mask) if m]


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, with the batch they were generated in.

    Groups are what the `rollouts` channel scatters, so a group never splits across trainer ranks.
    """

    rollouts: list[Rollout]
    batch_index: int
    policy_version: int  # the generator's policy version when the batch was sampled
    generation_seconds: float  # wall time of the whole generation batch
    batch_tokens: int  # completion tokens generated in the whole batch
    eval_version: int | None = None  # an evaluation of this policy version (eval_dataset), not a training batch
    position: int = -1  # the prompt's place in its batch (`schedule.trainer_positions`); -1: not known
    replica: int = 0  # the generator replica that sampled it (`batch_tokens` and the seconds are that replica's)
    weights_load_seconds: float = 0.0  # that replica's last load of new weights into its engine, before sampling
    cpu_seconds: float = 0.0  # that replica's process CPU time (every thread) since its previous tick closed
    data_offset: int = 0  # trainer replica groups: the generator's data offset when it sampled (global batch - batch)


@dataclass
class InFlightBatch:
    """A generation batch the generator has started and not finished (partial rollouts).

    `groups[i]` holds the `num_generations` rollouts of the batch's i-th prompt; the batch leaves
    the generator, as `RolloutGroup`s, once every rollout is finished.
    """

    batch_index: int
    policy_version: int  # the generator's policy version when the batch was started
    groups: list[list[Rollout]]
    positions: list[int] = field(default_factory=list)  # each group's place in the batch (this replica's share)
    data_offset: int = 0  # trainer replica groups: the generator's data offset when the batch was started

    def unfinished(self) -> list[Rollout]:
        return [r for group in self.groups for r in group if r.finish_reason == UNFINISHED]


def split_by_position(prompts_per_batch: int):
    """The SCATTER split of the `rollouts` channel: a training group goes to the trainer rank that trains its
    position (`schedule.position_owner`), whichever replica generated it; groups without a position (an
    evaluation, or a single generator's whole batch in order) are shared as `split_by_batch` does."""
    from hfllamarl.runtime.loop.schedule import position_owner

    def split(groups: list[RolloutGroup], parts: int) -> list[list[RolloutGroup]]:
        placed = [g for g in groups if g.position >= 0 and g.eval_version is None]
        chunks = split_by_batch([g for g in groups if not (g.position >= 0 and g.eval_version is None)], parts)
        for g in placed:
            chunks[position_owner(g.position, prompts_per_batch, parts)].append(g)
        return chunks

    return split


def split_by_batch(groups: list[RolloutGroup], parts: int) -> list[list[RolloutGroup]]:
    """Cut the groups the generator sends in one tick into one chunk per trainer rank, batch by batch: with
    partial rollouts several batches can finish in one tick, and each trainer rank must get its share of
    every batch (not batch k on one rank and batch k+1 on another)."""
    from hfllamarl.runtime.loop.channels import split_even

    chunks: list[list[RolloutGroup]] = [[] for _ in range(parts)]
    order: list[int] = []
    by_batch: dict[int, list[RolloutGroup]] = {}
    for g in groups:
        if g.batch_index not in by_batch:
            order.append(g.batch_index)
        by_batch.setdefault(g.batch_index, []).append(g)
    for b in order:
        for chunk, share in zip(chunks, split_even(by_batch[b], parts)):
            first = by_batch[b][0]
            if not share and first.eval_version is not None:  # every trainer rank takes part in an evaluation
                share = [RolloutGroup([], b, first.policy_version, first.generation_seconds, first.batch_tokens,
                                      first.eval_version)]
            chunk.extend(share)
    return chunks


def sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token `ids[t]` from a vLLM completion's `logprobs` (requested with
    `logprobs=0`: the sampled token alone at each position). vLLM keeps them either as one `{token: Logprob}` dict
    per position or, under `SamplingParams(flat_logprobs=True)`, as `FlatLogprobs`: flat lists whose position t
    spans `start_indices[t]:end_indices[t]`, the sampled token first. Raises when they do not cover every token."""
    logprobs = logprobs if logprobs is not None else []
    if all(hasattr(logprobs, a) for a in ("start_indices", "token_ids", "logprobs")):  # FlatLogprobs
        starts, tokens, values = logprobs.start_indices, logprobs.token_ids, logprobs.logprobs
        out = [float(values[s]) for s, t in zip(starts, ids) if tokens[s] == t]
    else:
        out = [float(lp[t].logprob) for lp, t in zip(logprobs, ids) if t in lp]
    if len(out) != len(ids) or len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(out)} matching log-probs for a completion")
    return out
