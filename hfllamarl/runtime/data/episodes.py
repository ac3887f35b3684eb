"""What a multi-turn rollout carries besides its tokens, and how the trainer ranks read it.

`Rollout.episode` is an `Episode`: the completion as the messages TRL hands to reward functions (assistant
turns parsed from the tokens, tool results), the tool calls made, failed and timed out, and the rollout's
environment. On the generator the environment is the live instance; when the rollout finishes it is replaced
by a pickled copy (cloudpickle, so a class defined in the user's script travels too), which the trainer ranks
unpickle into the `environments` argument of the reward functions, as TRL passes its live instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hfllamarl.runtime.data.prompts import is_conversational


@dataclass
class Episode:
    """The multi-turn side of one rollout (see the module docstring)."""

    messages: list[dict] = field(default_factory=list)  # the completion: assistant and tool messages, in order
    tool_calls: int = 0
    tool_failures: int = 0  # raised, unknown tool, malformed call, or timed out (TRL's failures)
    tool_timeouts: int = 0
    iterations: int = 0  # tool-calling rounds so far (bounded by max_tool_calling_iterations)
    tool_seconds: float = 0.0  # wall-clock its tool calls took so far (bounded by rollout_time_budget_s)
    calls_refused: int = 0  # calls not run: past max_tool_calls_per_turn, or past the time budget
    ended_by: str | None = None  # "calls_per_turn" or "time_budget" when a bound ended the rollout
    abandoned: bool = False  # a call of this rollout was left running (its environment is not reused)
    turn_start: int = 0  # where the current assistant turn starts in completion_ids
    environment_name: Any = None  # the key of its factory (None for a single environment_factory)
    environment: Any = None  # generator: the live instance; sent to the trainer: its pickled copy (bytes)

    def __getstate__(self):
        state = dict(self.__dict__)
        env = state["environment"]
        if env is not None and not isinstance(env, bytes):  # a live instance, in a checkpoint
            try:
                state["environment"] = pickled(env)
            except Exception as exc:
                raise TypeError(
                    f"cannot save the environment {type(env).__name__} of a rollout still in flight at this "
                    f"checkpoint: {type(exc).__name__}: {exc}. Make it picklable (__getstate__/__setstate__ leaving "
                    "out what cannot be saved, e.g. a connection, and opening it again), or run without "
                    "partial_rollout_tokens (then no rollout is in flight at a checkpoint).") from exc
        return state


def pickled(obj) -> bytes:
    """cloudpickle: functions and classes of the user's `__main__` travel by value to other processes."""
    import cloudpickle

    return cloudpickle.dumps(obj)


def unpickled(data: bytes):
    import pickle

    return pickle.loads(data)


class UnpicklableEnvironment:
    """Stands for an environment that could not be pickled to reach the trainer ranks; any use says why."""

    def __init__(self, name: str, reason: str):
        self._name, self._reason = name, reason

    def __getattr__(self, attribute):
        if attribute.startswith("_"):  # pickle's own look-ups (__setstate__, ...) and our fields before they are set
            raise AttributeError(attribute)
        raise RuntimeError(
            f"the environment {self._name} could not be pickled to reach the trainer ranks, where reward functions "
            f"run ({self._reason}); a reward function read `environments[i].{attribute}`. Make the environment "
            "picklable (e.g. __getstate__ leaving out connections), or score it with get_reward(), which runs on "
            "the generator next to the live environment.")


def snapshot(environment) -> bytes:
    """The environment as the trainer ranks will see it (its state when the rollout finished)."""
    try:
        return pickled(environment)
    except Exception as exc:
        return pickled(UnpicklableEnvironment(type(environment).__name__, f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------------- trainer side
def reward_arguments(rollouts: list) -> dict:
    """The reward path's arguments for `rollouts` (`RewardRunner.__call__`): prompts, completions (strings, chat
    messages, or a multi-turn rollout's messages), completion ids, the dataset columns plus what TRL adds
    (`environments`, a rollout_func's extra fields, already in the columns), and scores computed elsewhere."""
    # (as TRL: a data set's own completion columns are not passed; the sampled completions are)
    columns = {k: [r.columns.get(k) for r in rollouts] for k in (rollouts[0].columns if rollouts else {})
               if k not in ("completion", "completion_ids")}
    if any(r.episode is not None and r.episode.environment is not None for r in rollouts):
        columns["environments"] = [_environment(r) for r in rollouts]
    return dict(prompts=[r.prompt for r in rollouts], completions=[completion(r) for r in rollouts],
                completion_ids=[r.completion_ids for r in rollouts], columns=columns, scored=_scored(rollouts))


def completion(r):
    """What reward functions get as the completion: a multi-turn rollout's messages, else its text (the reward path
    wraps text as one assistant message for chat prompts)."""
    if r.episode is not None and r.episode.messages and is_conversational(r.prompt):
        return list(r.episode.messages)
    return r.completion_text


def _environment(r):
    env = r.episode.environment if r.episode is not None else None
    return unpickled(env) if isinstance(env, bytes) else env


def _scored(rollouts: list) -> dict[str, list]:
    """Scores computed on the generator (reward models, environments' get_reward), by name: only the names every
    rollout has."""
    names = set(getattr(rollouts[0], "model_rewards", {})) if rollouts else set()
    for r in rollouts[1:]:
        names &= set(getattr(r, "model_rewards", {}))
    return {name: [r.model_rewards[name] for r in rollouts] for name in names}


def tool_counts(rollouts: list) -> dict[str, float]:
    """This rank's tool calls, failures, timeouts, calls refused and rollouts a bound ended (summed over the trainer
    ranks before `tool_metrics`)."""
    episodes = [r.episode for r in rollouts if r.episode is not None]
    return {"tool_calls": float(sum(e.tool_calls for e in episodes)),
            "tool_failures": float(sum(e.tool_failures for e in episodes)),
            "tool_timeouts": float(sum(e.tool_timeouts for e in episodes)),
            "tool_calls_refused": float(sum(e.calls_refused for e in episodes)),
            "tool_ended_by_budget": float(sum(e.ended_by is not None for e in episodes))}


def tool_metrics(summed: dict[str, float], completions: float) -> dict[str, float]:
    """TRL's tool metrics (calls per completion, failed share of calls), plus the timed-out share of calls, the calls
    the per-turn and per-rollout bounds refused, and the completions those bounds ended (counts in the step)."""
    calls = summed["tool_calls"]
    return {"tools/calls_refused": summed["tool_calls_refused"],
            "tools/ended_by_budget": summed["tool_ended_by_budget"],
            "tools/call_frequency": calls / max(completions, 1.0),
            "tools/failure_frequency": summed["tool_failures"] / calls if calls else 0.0,
            "tools/timeout_frequency": summed["tool_timeouts"] / calls if calls else 0.0}
