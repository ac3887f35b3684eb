"""Running the tool calls a model makes, each bounded in time, as TRL's `GRPOTrainer` runs them.

A rollout's parsed tool calls (`{"type": "function", "function": {"name", "arguments"}}`) run against its
tools by name: its synchronous tools one after the other in the order called, then its `async def` tools
together, so the results come back in TRL's order (synchronous ones first). Every failure becomes a result
the model reads, never an exception of the job: a tool that raises gives `{"error": str(exc)}` (TRL's text),
an unknown tool `{"error": "Tool <name> not found."}`, and a call that runs past `timeout_s` is abandoned
and gives an error saying so.

A synchronous tool runs in a daemon thread of its own, so one that hangs is left behind after its timeout
(Python cannot stop a thread; it is counted in `abandoned`) while the rollout goes on. The `async def` calls of
one turn run together on an event loop of their own, in a daemon thread of its own, each under
`asyncio.wait_for`; the loop is closed when they are done (`asyncio.run`). So a coroutine that hogs or blocks its
loop delays only the calls of its own turn: no other rollout's call shares that loop. A loop stuck in such a
coroutine is abandoned at the bound (counted in `abandoned`) and closes itself if the coroutine ever returns.
Unlike TRL's one event loop for the whole trainer, no loop outlives its turn: an async tool must not keep
loop-bound objects (an `aiohttp.ClientSession`, an `asyncio.Lock`) from one call to the next.

Each rollout's turn runs in a thread of its own (`submit`), so rollouts run their calls concurrently and a slow
rollout never holds back another one's next turn. A turn may carry a time budget (what is left of the rollout's
`rollout_time_budget_s`): no call starts past it, and the call running when it runs out is abandoned then, as at
its own timeout; the turn reports the calls it could not run (`TurnResult.refused`). So one turn never takes
longer than the smaller of its budget and (calls x `timeout_s`, plus 1 s for a stuck event loop).
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
    over_budget: bool = False  # abandoned when the turn's time budget ran out (it gives the model no result)

    def message(self) -> dict:
        """TRL's tool message: text, or a list of content blocks as the tool returned it."""
        content = self.content if isinstance(self.content, list) else str(self.content)
        return {"role": "tool", "name": self.name, "content": content}


@dataclass
class TurnResult:
    """One rollout's turn of calls: the results the model reads (TRL's order), how long the calls took, and, when
    the time budget ran out (`over_budget`), how many calls gave no result (never started, or abandoned then)."""

    results: list[ToolResult]
    seconds: float = 0.0
    refused: int = 0
    over_budget: bool = False


def _error(name: str, text: str, timed_out: bool = False) -> ToolResult:
    return ToolResult(name, {"error": text}, failed=True, timed_out=timed_out)


def is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def tool_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class ToolRunner:
    """Runs tool calls with a time bound per call, and optionally per turn.

    Args:
        timeout_s: the longest one call may run before it is abandoned and reported as failed.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"tool_call_timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.abandoned = 0  # threads (or event loops) left running after a timeout
        self._lock = threading.Lock()

    def submit(self, calls: list, tools: dict[str, Callable], budget_s: float | None = None
               ) -> concurrent.futures.Future:
        """Start one rollout's turn (its parsed tool calls, its tools by name) in a thread of its own; the future
        gives its `TurnResult`. `budget_s`: the seconds this turn may take (None: only the per-call bound)."""
        # One thread per turn, not a pool: a queue would make a turn wait for others before its budget starts.
        return _in_thread("hfllamarl-tools-turn", self._run_turn, calls, tools, budget_s)

    def submit_call(self, name: str, fn: Callable, kwargs: dict) -> concurrent.futures.Future:
        """`call` in a thread of its own (e.g. a finishing rollout's `get_reward`, next to the others'); the future
        gives its `ToolResult` within `timeout_s` + 1 s."""
        return _in_thread(f"hfllamarl-{name}", self.call, name, fn, kwargs)

    def run(self, jobs: list[tuple[list, dict[str, Callable]]]) -> list[list[ToolResult]]:
        """`jobs[i]` = (rollout i's parsed tool calls, its tools by name); returns each rollout's results, in TRL's
        order. Rollouts run concurrently; a rollout's synchronous calls run in order."""
        futures = [self.submit(calls, tools) for calls, tools in jobs]
        return [f.result(self.turn_bound(len(calls), None) + 5.0).results for f, (calls, _) in zip(futures, jobs)]

    def turn_bound(self, num_calls: int, budget_s: float | None) -> float:
        """The longest a turn of `num_calls` calls can take: its synchronous calls one after the other, its async
        ones together (plus 1 s for a stuck event loop), never past its budget."""
        bound = num_calls * self.timeout_s + 1.0
        return bound if budget_s is None else min(bound, max(budget_s, 0.0))

    def call(self, name: str, fn: Callable, kwargs: dict) -> ToolResult:
        """One bounded call of `fn(**kwargs)` (sync or async) outside a tool-calling turn (e.g. `get_reward`)."""
        if is_async(fn):
            return self._run_async([(name, fn, kwargs)], None)[0]
        return self._run_sync(name, fn, kwargs, self.timeout_s)

    def close(self) -> None:
        """Nothing to release: every turn's event loop closes with it."""

    # ------------------------------------------------------------------ internals
    def _run_turn(self, calls: list, tools: dict[str, Callable], budget_s: float | None) -> TurnResult:
        start = time.monotonic()
        deadline = None if budget_s is None else start + budget_s
        results, pending_async, refused = [], [], 0
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
                limit = self._limit(deadline)
                if limit <= 0:  # the budget is spent: this call is not started
                    refused += 1
                    continue
                result = self._run_sync(name, fn, function.get("arguments"), limit)
                if result.timed_out and limit < self.timeout_s:  # abandoned at the budget, not at its own bound
                    refused += 1
                else:
                    results.append(result)
        if pending_async:
            if self._limit(deadline) <= 0:
                refused += len(pending_async)
            else:
                for result in self._run_async(pending_async, deadline):
                    if result.over_budget:
                        refused += 1
                    else:
                        results.append(result)
        return TurnResult(results, time.monotonic() - start, refused, over_budget=refused > 0)

    def _limit(self, deadline: float | None) -> float:
        """How long the next call may run: its own bound, or what is left of the turn's budget if less."""
        return self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.monotonic())

    def _run_sync(self, name: str, fn: Callable, arguments, limit: float) -> ToolResult:
        box: dict[str, Any] = {}

        def target():
            try:
                box["value"] = fn(**arguments)
            except BaseException as exc:  # a tool's failure is the model's to read
                box["error"] = exc

        worker = threading.Thread(target=target, name=f"hfllamarl-tool-{name}", daemon=True)
        worker.start()
        worker.join(limit)
        if worker.is_alive():
            with self._lock:
                self.abandoned += 1
            return _error(name, f"Tool {name} did not finish within {self.timeout_s:g} s and was abandoned.", True)
        if "error" in box:
            return _error(name, str(box["error"]))
        return ToolResult(name, box.get("value"))

    def _run_async(self, calls: list[tuple[str, Callable, Any]], deadline: float | None) -> list[ToolResult]:
        """The calls together on an event loop of their own; each ends at its own bound or at `deadline` (the turn's
        budget), whichever comes first (then it is marked `over_budget`)."""
        limit = self._limit(deadline)
        futures = [concurrent.futures.Future() for _ in calls]

        async def bounded(fn, arguments, future):
            try:
                future.set_result(await asyncio.wait_for(fn(**arguments), limit))
            except BaseException as exc:  # a tool's failure (or arguments that are not a mapping): the model's to read
                future.set_exception(exc)

        async def together():
            await asyncio.gather(*(bounded(fn, arguments, f) for (_, fn, arguments), f in zip(calls, futures)))

        # asyncio.run: a new loop, closed (its leftover tasks cancelled) when the calls are done, even late.
        threading.Thread(target=asyncio.run, args=(together(),), name="hfllamarl-tools-loop", daemon=True).start()
        results, stuck = [], False
        # wait_for ends each call by `limit`, unless the loop itself is stuck: then 1 s later, or at the budget.
        end = time.monotonic() + limit + 1.0
        cut_at_deadline = deadline is not None and deadline < end
        end = deadline if cut_at_deadline else end
        for (name, _, _), future in zip(calls, futures):
            try:
                results.append(ToolResult(name, future.result(max(end - time.monotonic(), 0.0))))
            except (asyncio.TimeoutError, TimeoutError, concurrent.futures.TimeoutError):
                stuck = stuck or not future.done()  # the loop is stuck in a coroutine: leave it behind
                result = _error(name, f"Tool {name} did not finish within {self.timeout_s:g} s and was abandoned.",
                                True)
                result.over_budget = limit < self.timeout_s or (not future.done() and cut_at_deadline)
                results.append(result)
            except BaseException as exc:
                results.append(_error(name, str(exc)))
        if stuck:
            with self._lock:
                self.abandoned += 1
        return results


def _in_thread(name: str, fn: Callable, *args) -> concurrent.futures.Future:
    """`fn(*args)` in a daemon thread of its own; the future gives its result, or what it raised (a bug of the
    runner, not a tool's failure: tools' failures are results)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future
