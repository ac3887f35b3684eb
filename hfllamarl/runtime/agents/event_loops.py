"""The event loops `async def` tools run on: one per environment instance, one shared by the standalone tools.

TRL runs every async tool on one event loop that lives as long as the trainer, so users write tools and
environments that keep loop-bound objects between calls (an `aiohttp.ClientSession`, an `asyncio.Lock` or
`asyncio.Queue` that was waited on, a background task, a future). Here:

- an environment instance gets an event loop of its own, in a daemon thread of its own, created on its first
  async call and reused for every call of every rollout that instance serves (its tools and an async
  `get_reward`), so its loop-bound objects keep working across turns and across `reset()`; a coroutine that
  blocks the loop (a `time.sleep` inside `async def`) blocks only that environment's calls;
- the standalone async tools (functions passed in `tools=`) share one loop, as in TRL (their module globals are
  shared by every rollout in TRL too).

A loop that a coroutine keeps blocked past its call's bound is abandoned (`abandon`): it is no longer handed
out (the shared one is replaced by a new loop on the next call; the environment it served is not reused by the
multi-turn runner), and it stops and closes itself if that coroutine ever returns. An environment's loop closes
when the instance is garbage-collected, when the runner releases it (`release`: an environment the pool drops),
or when the runner closes. No loop is stored on the environment itself: instances are pickled (cloudpickle)
into checkpoints and sent to the trainer ranks, and a loop or a thread cannot be pickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Coroutine

_STOP_LOCK = threading.Lock()
_CANCEL_S = 1.0  # how long a stopping loop lets its leftover tasks handle their cancellation before it closes


class LoopThread:
    """An event loop running forever in a daemon thread of its own until `stop`.

    Args:
        name: the thread's name (shows in stack dumps).
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._stopping = threading.Event()  # stop once: a second loop.stop would cut the cancellation short
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        """Run `coroutine` on this loop; the future gives its result (raises RuntimeError if the loop is closed)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        """Stop the loop once it is free (at once, unless a coroutine blocks it); it then cancels its tasks and
        closes."""
        with _STOP_LOCK:
            if self._stopping.is_set():
                return
            self._stopping.set()
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            pass

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:  # tasks left running (an environment's background task): cancel them, bounded, then close
                tasks = asyncio.all_tasks(self.loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    self.loop.run_until_complete(asyncio.wait(tasks, timeout=_CANCEL_S))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()


class EventLoops:
    """The loops of one `ToolRunner`: `get(None)` is the standalone tools' shared loop, `get(environment)` that
    environment's own (both created on first use)."""

    def __init__(self):
        self._shared: LoopThread | None = None
        # id(environment) -> (its loop, the instance itself if it cannot be weakly referenced: kept alive so that
        # its id is not reused by another object while the entry exists)
        self._owned: dict[int, tuple[LoopThread, object]] = {}
        self._lock = threading.RLock()  # re-entrant: a finalizer may run (garbage collection) while it is held

    def get(self, environment=None) -> LoopThread:
        """The loop for `environment`'s async calls (None: a standalone tool's)."""
        with self._lock:
            if environment is None:
                if self._shared is None:
                    self._shared = LoopThread("hfllamarl-tools-loop")
                return self._shared
            key = id(environment)
            entry = self._owned.get(key)
            if entry is None:
                loop = LoopThread(f"hfllamarl-loop-{type(environment).__name__}")
                try:  # closed when the instance is collected
                    weakref.finalize(environment, self._forget, key, loop)
                    entry = (loop, None)
                except TypeError:  # no weak references (__slots__): until `release` or `close`
                    entry = (loop, environment)
                self._owned[key] = entry
            return entry[0]

    def abandon(self, loop: LoopThread) -> None:
        """A coroutine blocks `loop` past its bound: hand it out no more; it closes if that coroutine returns."""
        with self._lock:
            if self._shared is loop:
                self._shared = None
            for key in [k for k, (owned, _) in self._owned.items() if owned is loop]:
                del self._owned[key]
        loop.stop()

    def release(self, environment) -> None:
        """`environment` is dropped (e.g. not returned to the pool): close its loop, if it has one."""
        with self._lock:
            entry = self._owned.pop(id(environment), None)
        if entry is not None:
            entry[0].stop()

    def close(self) -> None:
        """Stop every loop (each closes once free)."""
        with self._lock:
            loops = [loop for loop, _ in self._owned.values()] + ([self._shared] if self._shared else [])
            self._owned, self._shared = {}, None
        for loop in loops:
            loop.stop()

    def __len__(self) -> int:
        """How many loops are handed out (the shared one included, once created)."""
        with self._lock:
            return len(self._owned) + (self._shared is not None)

    def _forget(self, key: int, loop: LoopThread) -> None:
        with self._lock:
            if self._owned.get(key, (None,))[0] is loop:
                del self._owned[key]
        loop.stop()
