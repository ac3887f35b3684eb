"""The executor interface every role implements (paper, Algorithm 1).

An executor owns one role's work (generating, training). The controller drives it: once per
tick it calls `set_step`, lets every channel move data in and out through `get_output` /
`put_input`, calls `step`, and `save_checkpoint` when one is due.
"""

from __future__ import annotations

from typing import Any

from hfllamarl.runtime.world.liveness import STARTUP


class Executor:
    """Base class of the generator and trainer executors."""

    role: str = "executor"
    stopped: bool = False  # the trainer ranks ended the run early (a callback's should_training_stop): no more ticks
    first_tick: int = 0  # known by the end of `init`: the tick this job's loop starts at (a bootstrapped start's)

    def init(self) -> None:
        """Called once before the first tick: build the model, the engine, the optimizer."""

    def set_step(self, tick: int) -> None:
        """Called at the start of every tick, before any channel communicates."""
        self.tick = tick

    def get_output(self, channel: str) -> Any:
        """Called on a channel's source ranks: the payload this executor sends this tick."""
        raise KeyError(f"{type(self).__name__} has no output {channel!r}")

    def put_input(self, channel: str, value: Any) -> None:
        """Called on a channel's destination ranks with what arrived this tick."""
        raise KeyError(f"{type(self).__name__} takes no input {channel!r}")

    def step(self) -> None:
        """Called once per tick after the channels before it: this executor's work for the tick."""

    def checkpoint_due(self) -> bool:
        """Called after every tick: whether `save_checkpoint` should run now."""
        return False

    def save_checkpoint(self) -> None:
        """Called after a tick when `checkpoint_due()` said so."""

    def stop_requested(self) -> bool:
        """Called on every trainer rank first thing in every tick's weights channel: whether the run ends here
        (the same answer on every trainer rank)."""
        return False

    def close(self) -> None:
        """Called once after the last tick (and on the way out of an error)."""


def wait_for_startup(topology, budget_s: float) -> None:
    """Every executor calls this once its start-up is done (the trainer's policy loaded and sharded, the
    generator's vLLM engine up), before its first exchange: a rank still starting is waited for as long as
    `budget_s` (vllm_server_timeout) while it is alive, however short the collective timeout."""
    topology.liveness.rendezvous(STARTUP, budget_s, why=" (vllm_server_timeout: loading the model, starting vLLM)")
