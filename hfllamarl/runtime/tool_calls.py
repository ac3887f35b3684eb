"""Running the tool calls a model makes, each bounded in time, as TRL's `GRPOTrainer` runs them.

A rollout's parsed tool calls (`{"type": "function", "function": {"name", "arguments"}}`) run against its
tools by name: its synchronous tools one after the other in the order called, then its `async def` tools
together, so the results come back in TRL's order (synchronous ones first). Every failure becomes a result
the model reads, never an exception of the job: a tool that raises gives `{"error": str(exc)}` (TRL's text),
an unknown tool `{"error": "Tool <name> not found."}`, and a call that runs past `timeout_s` is abandoned
and gives an error saying so.

A synchronous tool runs in a daemon thread of its own, so one that hangs is left behind after its timeout
(Python cannot stop a thread; it is counted in `abandoned`) while the rollout goes on. `async def` tools run
on one event loop in a daemon thread under `asyncio.wait_for`; a coroutine that blocks the loop itself is
abandoned together with its loop, and the next call gets a new loop. Rollouts run their calls concurrently.
Tool code is the user's; model output only chooses the tool and its arguments (never evaluated).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolResult:
    """The outcome of one tool call: `content` goes into the tool message the model reads next."""

    name: str
    content: Any
    failed: bool = False
    timed_out: bool = False

    def message(self) -> dict:
        """TRL's tool message: text, or a list of content blocks as the tool returned it."""
        content = self.content if isinstance(self.content, list) else str(self.content)
        return {"role": "tool", "name": self.name, "content": content}


def _error(name: str, text: str, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, {"error": text}, failed=True, timed_out=timed_out)


def is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def tool_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class ToolRunner:
    """Runs tool calls with a time bound per call.

    Args:
        timeout_s: the longest one call may run before it is abandoned and reported as failed.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"tool_call_timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.abandoned = 0  # threads (or event loops) left running after a timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="hfllamarl-tools")

    def run(self, jobs: list[tuple[list, dict[str, Callable]]]) -> list[list[ToolResult]]:
        """`jobs[i]` = (rollout i's parsed tool calls, its tools by name); returns each rollout's results, in TRL's
        order. Rollouts run concurrently; a rollout's synchronous calls run in order."""
        futures = [self._pool.submit(self._run_rollout, calls, tools) for calls, tools in jobs]
        # Each rollout waits at most timeout_s per call (plus a margin): never longer than that.
        return [f.result() for f in futures]

    def call(self, name: str, fn: Callable, kwargs: dict) -> ToolResult:
        """One bounded call of `fn(**kwargs)` (sync or async) outside a tool-calling turn (e.g. `get_reward`)."""
        if is_async(fn):
            return self._run_async([(name, fn, kwargs)])[0]
        return self._run_sync(name, fn, kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    # ------------------------------------------------------------------ internals
    def _run_rollout(self, calls: list, tools: dict[str, Callable]) -> list[ToolResult]:
        results, pending_async = [], []
        for call in calls:
            if not isinstance(call, dict) or call.get("type") != "function":
                kind = call.get("type") if isinstance(call, dict) else type(call).__name__
                name = call.get("name", "unknown") if isinstance(call, dict) else "unknown"
                results.append(_error(name, f"Unsupported tool call type: {kind}"))
                continue
            function = call.get("function") or {}
            name = function.get("name")
            fn = tools.get(name)
            if fn is None:
                results.append(_error(str(name), f"Tool {name} not found."))
            elif is_async(fn):
                pending_async.append((name, fn, function.get("arguments")))
            else:
                results.append(self._run_sync(name, fn, function.get("arguments")))
        if pending_async:
            results += self._run_async(pending_async)
        return results

    def _run_sync(self, name: str, fn: Callable, arguments) -> ToolResult:
        box: dict[str, Any] = {}

        def target():
            try:
                box["value"] = fn(**arguments)
            except BaseException as exc:  # a tool's failure is the model's to read
                box["error"] = exc

        worker = threading.Thread(target=target, name=f"hfllamarl-tool-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self.abandoned += 1
            return _error(name, f"Tool {name} did not finish within {self.timeout_s:g} s and was abandoned.", True)
        if "error" in box:
            return _error(name, str(box["error"]))
        return ToolResult(name, box.get("value"))

    def _run_async(self, calls: list[tuple[str, Callable, Any]]) -> list[ToolResult]:
        loop = self._event_loop()

        async def bounded(fn, arguments):
            return await asyncio.wait_for(fn(**arguments), self.timeout_s)

        futures = []
        for name, fn, arguments in calls:
            try:
                futures.append(asyncio.run_coroutine_threadsafe(bounded(fn, arguments), loop))
            except BaseException as exc:  # e.g. arguments that are not a mapping
                futures.append(exc)
        results = []
        deadline = time.monotonic() + self.timeout_s + 1.0  # wait_for ends each call by then, unless the loop is stuck
        for (name, _, _), future in zip(calls, futures):
            if isinstance(future, BaseException):
                results.append(_error(name, str(future)))
                continue
            try:
                results.append(ToolResult(name, future.result(max(deadline - time.monotonic(), 0.0))))
            except (asyncio.TimeoutError, TimeoutError, concurrent.futures.TimeoutError):
                if not future.done():  # the loop itself is stuck in the coroutine: leave it, start another
                    self._abandon_loop(loop)
                results.append(_error(name, f"Tool {name} did not finish within {self.timeout_s:g} s and was "
                                            "abandoned.", True))
            except BaseException as exc:
                results.append(_error(name, str(exc)))
        return results

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="hfllamarl-tools-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    def _abandon_loop(self, loop) -> None:
        with self._lock:
            if self._loop is loop:
                self._loop = None
                self.abandoned += 1
