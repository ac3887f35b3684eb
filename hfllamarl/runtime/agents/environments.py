"""Environments with TRL's `environment_factory` contract, created per rollout on the generator ranks.

`environment_factory` is a callable returning an environment, an installed environment plugin's name
(entry-point group `hfllamarl.environments`), or a dict of either by name (each dataset row then names its
environment in an `environment` column, as in TRL). An environment has:

- `reset(**row) -> str | None`: called before each rollout with the dataset row; a string is appended to the
  prompt's last user message;
- tools: its public methods other than `reset` and `get_reward` (type hints and a Google-style docstring give
  the schema the model reads), called when the model calls them;
- optionally `get_reward() -> float` (or `async def`, run on the instance's own event loop, like its async
  tools): called once when its rollout finishes, next to the live environment on the generator; the score is a
  reward logged under the class name, weight 1, as TRL. The finishing rollouts' calls run together, each bounded
  by `tool_call_timeout_s`; one past it leaves its rollout unscored (None, as TRL's NaN), never 0 and never a
  job stop (`MultiTurn._settle_rewards`).

Instances are pooled and reused (`reset` each time), as TRL does: the pool grows only when more rollouts run
at once than there are instances. An instance's `async def` methods run on an event loop of its own that lives as
long as the instance (`hfllamarl.runtime.agents.event_loops`), so loop-bound objects it keeps (a session, a lock, a
queue, a background task) work across turns, rollouts and `reset`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hfllamarl.registry import PluginError, installed, load_plugin

NOT_TOOLS = ("reset", "get_reward")


@dataclass
class EnvironmentKind:
    """What probing one instance of a factory told: its class name, its tools' names, whether it scores itself."""

    factory: Callable
    class_name: str
    tool_names: list[str]
    has_reward: bool


def resolve_factories(environment_factory) -> dict[Any, Callable] | None:
    """`environment_factory` as `{name: factory}` (the key None for a single factory); plugin names loaded."""
    if environment_factory is None:
        return None
    if isinstance(environment_factory, dict):
        if not environment_factory:
            raise ValueError("environment_factory is an empty dict: give at least one environment.")
        return {name: _factory(value, f"environment_factory[{name!r}]") for name, value in environment_factory.items()}
    return {None: _factory(environment_factory, "environment_factory")}


def _factory(value, where: str) -> Callable:
    if isinstance(value, str):
        try:
            return load_plugin("environments", value)
        except PluginError as exc:
            raise PluginError(f"{where}={value!r}: {exc}") from None
    if not callable(value):
        raise TypeError(f"{where} must be a callable that returns an environment (e.g. its class) or the name of an "
                        f"installed environment plugin ({', '.join(sorted(installed('environments'))) or 'none'}); "
                        f"got {type(value).__name__}.")
    return value


def tool_methods(environment) -> list[Callable]:
    """The environment's tools, as TRL lists them: public functions of its class (by name), bound to it."""
    members = inspect.getmembers(type(environment), predicate=inspect.isfunction)  # on the class: no property runs
    return [getattr(environment, name) for name, _ in members if name not in NOT_TOOLS and not name.startswith("_")]


def probe(factories: dict[Any, Callable]) -> tuple[dict[Any, EnvironmentKind], dict[Any, Any]]:
    """Create one instance of each environment to check it and learn its tools (TRL does the same at start-up).
    Returns the kinds and the instances (to seed the pools)."""
    kinds, instances = {}, {}
    for name, factory in factories.items():
        instance = factory()
        members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
        label = f"environment {name!r}" if name is not None else "the environment"
        if "reset" not in members:
            raise ValueError(f"{label} ({type(instance).__name__}) has no `reset` method: every environment "
                             "returned by environment_factory must define reset(**row) -> str | None.")
        kinds[name] = EnvironmentKind(factory, type(instance).__name__, [m.__name__ for m in tool_methods(instance)],
                                      "get_reward" in members)
        instances[name] = instance
    return kinds, instances


@dataclass
class EnvironmentPool:
    """Reusable instances per environment name (created on demand)."""

    kinds: dict[Any, EnvironmentKind]
    free: dict[Any, list] = field(default_factory=dict)

    def seed(self, instances: dict[Any, Any]) -> None:
        for name, instance in instances.items():
            self.free.setdefault(name, []).append(instance)

    def take(self, name):
        if name not in self.kinds:
            raise ValueError(f"a dataset row has environment={name!r}, which is not among the environments passed to "
                             f"environment_factory: {sorted(map(str, self.kinds))}.")
        free = self.free.setdefault(name, [])
        return free.pop() if free else self.kinds[name].factory()

    def give_back(self, name, instance) -> None:
        self.free.setdefault(name, []).append(instance)


class EnvironmentReward:
    """The reward of the environments of one class (`get_reward()`), named after the class, as TRL adds it.

    Scored on the generator next to the live environment as each rollout finishes (the trainer ranks receive
    the scores with the rollouts); called on the trainer ranks only if a score is missing, on the environments'
    pickled copies. A rollout whose environment is of another class gets None.
    """

    def __init__(self, class_name: str):
        self.__name__ = class_name

    def __call__(self, environments=None, **kwargs) -> list[float | None]:
        if environments is None:
            raise ValueError(f"the {self.__name__} reward needs the rollouts' environments.")
        return [float(e.get_reward()) if type(e).__name__ == self.__name__ else None for e in environments]


def reward_kinds(kinds: dict[Any, EnvironmentKind]) -> list[str]:
    """Class names of the environments that score themselves, each once (two names may share a class)."""
    names = []
    for kind in kinds.values():
        if kind.has_reward and kind.class_name not in names:
            names.append(kind.class_name)
    return names
