"""Running the tool calls a model makes, each bounded in time, as TRL's `GRPOTrainer` runs them.

A rollout's parsed tool calls (`{"type": "function", "function": {"name", "arguments"}}`) run against its
tools by name: its synchronous tools one after the other in the order called, then its `async def` tools
together, so the results come back in TRL's order (synchronous ones first). Every failure becomes a result
the model reads, never an exception of the job: a tool that raises gives `{"error": str(exc)}` (TRL's text),
an unknown tool `{"error": "Tool <name> not found."}`, and a call that runs past `timeout_s` is abandoned
and gives an error saying so.

A synchronous tool runs in a daemon thread of its own, so one that hangs is left behind after its timeout
(Python cannot stop a thread; it is counted in `abandoned`) while the rollout goes on. `async def` tools run as
in TRL on event loops that outlive the call (`hfllamarl.runtime.agents.event_loops`), each call under
`asyncio.wait_for`: an environment's methods (and its async `get_reward`) on that environment's own loop, which
lives as long as the instance, so loop-bound objects it keeps (a session, a lock, a queue, a background task)
work from one turn and one rollout to the next; the standalone async tools on one shared loop. A coroutine that
blocks its loop delays only the calls on that loop: another environment's calls are unaffected. Such a loop is
abandoned at the call's bound + 1 s (counted in `abandoned`): the shared loop is replaced on the next call, an
environment's loop is dropped with its environment (which the multi-turn runner does not reuse).

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

from hfllamarl.runtime.agents.event_loops import EventLoops, LoopThread

_GRACE_S = 0.1  # a call cut at the turn's budget on a free loop reports its time-out within this


@dataclass
class ToolResult:
    """The outcome of one tool call: `content` goes into the tool message the model reads next."""

    name: str
    content: Any
    failed: bool = False
    timed_out: bool = False
    over_budget: bool = False  # abandoned when the turn's time budget ran out (it gives the model no result)

    def message(self) -> dict:
        """TRL's tool message: text, or a list of content blocks as the tool returned it (made valid text: what
        the tool printed is the model's doing, `valid_text`)."""
        content = self.content if isinstance(self.content, list) else str(self.content)
        return {"role": "tool", "name": self.name, "content": valid_text(content)}


def valid_text(value: Any) -> Any:
    """`value` with every string in it (in lists, tuples and dict values) made valid Unicode a tokenizer, a log and a
    parquet file take: a lone surrogate (``print(chr(0xd800))`` in model code, ``"\\ud800"`` in a tool call's JSON)
    becomes U+FFFD, the replacement character, as an invalid byte does when the tokenizer decodes; a string that is
valid already is returned as it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            # (a pair written as two escapes is the character it encodes; a lone one is U+FFFD)
            return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    if isinstance(value, list | tuple):
        return type(value)(valid_text(v) for v in value)
    if isinstance(value, dict):
        return {k: valid_text(v) for k, v in value.items()}
    return value


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
        self.loops = EventLoops()
        self._lock = threading.Lock()

    def submit(self, calls: list, tools: dict[str, Callable], budget_s: float | None = None,
               environment=None) -> concurrent.futures.Future:
        """Start one rollout's turn (its parsed tool calls, its tools by name) in a thread of its own; the future
        gives its `TurnResult`. `budget_s`: the seconds this turn may take (None: only the per-call bound).
        `environment`: the rollout's environment instance; its async methods run on its own event loop."""
        # One thread per turn, not a pool: a queue would make a turn wait for others before its budget starts.
        return _in_thread("hfllamarl-tools-turn", self._run_turn, calls, tools, budget_s, environment)

    def submit_call(self, name: str, fn: Callable, kwargs: dict, environment=None) -> concurrent.futures.Future:
        """`call` in a thread of its own (e.g. a finishing rollout's `get_reward`, next to the others'); the future
        gives its `ToolResult` within `timeout_s` + 1 s."""
        return _in_thread(f"hfllamarl-{name}", self.call, name, fn, kwargs, environment)

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

    def call(self, name: str, fn: Callable, kwargs: dict, environment=None) -> ToolResult:
        """One bounded call of `fn(**kwargs)` (sync or async) outside a tool-calling turn (e.g. `get_reward`; an async
        one runs on `environment`'s event loop when `fn` is its method)."""
        if is_async(fn):
            return self._run_async([(name, fn, kwargs)], None, environment)[0]
        return self._run_sync(name, fn, kwargs, self.timeout_s)

    def release(self, environment) -> None:
        """`environment` will not be used again (not returned to the pool): close its event loop."""
        self.loops.release(environment)

    def close(self) -> None:
        """Stop every event loop (each closes once its running coroutine, if any, returns)."""
        self.loops.close()

    # ------------------------------------------------------------------ internals
    def _run_turn(self, calls: list, tools: dict[str, Callable], budget_s: float | None, environment
                  ) -> TurnResult:
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
                for result in self._run_async(pending_async, deadline, environment):
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

    def _run_async(self, calls: list[tuple[str, Callable, Any]], deadline: float | None, environment=None
                   ) -> list[ToolResult]:
        """The calls together, each on its event loop (`environment`'s own for its methods, else the shared one);
        each ends at its own bound or at `deadline` (the turn's budget), whichever comes first (then it is marked
        `over_budget`). A loop still stuck in a call after that is abandoned."""
        limit = self._limit(deadline)
        started = []  # (name, its loop, its future, or the error raised starting it)
        for name, fn, arguments in calls:
            owner = environment if environment is not None and getattr(fn, "__self__", None) is environment else None
            loop = self.loops.get(owner)
            try:
                started.append((name, loop, loop.submit(_bounded(fn, arguments, limit))))
            except RuntimeError as exc:  # the loop closed meanwhile (runner closed, environment released)
                started.append((name, loop, exc))
        # wait_for ends each call by `limit`, unless its loop itself is stuck: then 1 s later, or at the budget.
        end = time.monotonic() + limit + 1.0
        cut_at_deadline = deadline is not None and deadline < end
        end = deadline if cut_at_deadline else end
        futures = [f for _, _, f in started if isinstance(f, concurrent.futures.Future)]
        concurrent.futures.wait(futures, timeout=max(end - time.monotonic(), 0.0))
        late = [f for f in futures if not f.done()]
        if late and cut_at_deadline:  # wait_for fires at the deadline too: give a free loop the moment to report it
            concurrent.futures.wait(late, timeout=_GRACE_S)
        results, stuck = [], []
        for name, loop, future in started:
            if not isinstance(future, concurrent.futures.Future):
                results.append(_error(name, str(future)))
            elif not future.done():  # its loop is stuck in a coroutine: leave the loop behind
                future.cancel()  # (the task is cancelled if the loop ever runs again)
                if loop not in stuck:
                    stuck.append(loop)
                result = _error(name, f"Tool {name} did not finish within {self.timeout_s:g} s and was abandoned.",
                                True)
                result.over_budget = limit < self.timeout_s or cut_at_deadline
                results.append(result)
            else:
                results.append(self._async_result(name, future, limit))
        for loop in stuck:
            self._abandon(loop)
        return results

    def _async_result(self, name: str, future: concurrent.futures.Future, limit: float) -> ToolResult:
        """The result of an async call that ended: its value, its failure, or its time-out at `limit`."""
        if future.cancelled():  # its loop was stopped under it (the runner closed, its environment released)
            return _error(name, f"Tool {name} was cancelled: its event loop was closed.")
        exc = future.exception()
        if exc is None:
            return ToolResult(name, future.result())
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            result = _error(name, f"Tool {name} did not finish within {self.timeout_s:g} s and was abandoned.", True)
            result.over_budget = limit < self.timeout_s
            return result
        return _error(name, str(exc))  # a tool's failure (or arguments that are not a mapping): the model's to read

    def _abandon(self, loop: LoopThread) -> None:
        self.loops.abandon(loop)
        with self._lock:
            self.abandoned += 1


async def _bounded(fn: Callable, arguments, limit: float):
    return await asyncio.wait_for(fn(**arguments), limit)


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
