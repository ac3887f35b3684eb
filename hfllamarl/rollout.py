"""What crosses the `rollouts` channel: sampled completions with their behaviour log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    `behavior_logprobs[t]` is log mu of `completion_ids[t]` under the policy version
    `versions[t]` that sampled it (a partial rollout resumed under new weights spans versions).
    """

    prompt: Any  # the dataset row's `prompt`: a string or a list of chat messages
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" or "length"
    completion_text: str
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions
    row_index: int = -1  # index of the prompt's row in the training dataset

    def __post_init__(self):
        if not (len(self.completion_ids) == len(self.behavior_logprobs) == len(self.versions)):
            raise ValueError("a rollout needs one behaviour log-prob and one version per completion token")


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
