"""Runs a batch of sandboxed checks on several workers at once, within one deadline.

A reward function hands :func:`run_checks` its workers (anything with ``call(*args, timeout=)`` that
raises :class:`hfllamarl.sandbox.client.SandboxTimeout` / ``SandboxError``, e.g.
one :class:`hfllamarl.sandbox.client.Sandbox` per core, or the same object several times when it takes
concurrent calls) and the argument tuples to check. One thread per worker takes the next check
from a shared queue, so a slow check holds up one worker, not the batch. Every check is bounded
twice: by its own ``sample_timeout_s`` (a pathological answer ends at its own timeout) and by the
batch's deadline. A check that did not finish is reported as such, never as a verdict: the caller
leaves it unscored.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from hfllamarl.sandbox import SandboxError, SandboxTimeout

__all__ = ["BUDGET_SPENT", "BatchOutcome", "SAMPLE_TIMEOUT", "WORKER_ERROR", "run_checks"]

MIN_CALL_S = 0.05  # less time than this left: the check is not started (it could not finish)
_CUT_SHORT_FRACTION = 0.75  # a check that timed out with less of its own bound was cut short by the deadline
_JOIN_MARGIN_S = 1.0  # a call overruns its timeout by milliseconds (kill and reap); this is plenty


#: Why a check did not finish (its entry of :attr:`BatchOutcome.failures`).
SAMPLE_TIMEOUT, BUDGET_SPENT, WORKER_ERROR = "sample_timeout", "budget_spent", "worker_error"


@dataclass
class BatchOutcome:
    """What :func:`run_checks` found, one entry per check.

    Attributes:
        results: The worker's answer, or None when the check did not finish.
        failures: None for a finished check; else why not: ``SAMPLE_TIMEOUT`` (it ran out of its own
            ``sample_timeout_s``, or of at least three quarters of it), ``BUDGET_SPENT`` (cut shorter,
            or never started, because the batch's deadline came) or ``WORKER_ERROR`` (the worker raised or crashed).
    """

    results: list[Any]
    failures: list[str | None]

    def count(self, reason: str) -> int:
        """How many checks did not finish for ``reason``."""
        return self.failures.count(reason)


def run_checks(workers: Sequence[Any], jobs: Sequence[tuple], *, sample_timeout_s: float,
               deadline: float) -> BatchOutcome:
    """Runs ``worker.call(*job, timeout=...)`` for every job, the workers in parallel.

    Args:
        workers: The workers, one thread each (the same object may appear several times when it
            takes concurrent calls).
        jobs: Argument tuples, one per check.
        sample_timeout_s: Seconds one check may take at most.
        deadline: ``time.monotonic()`` value by which every check has ended.

    Returns:
        The results in the order of ``jobs`` (None: did not finish) and the counts of why not.

    Raises:
        ValueError: ``workers`` is empty.
    """
    if not workers:
        raise ValueError("run_checks needs at least one worker.")
    outcome = BatchOutcome(results=[None] * len(jobs), failures=[BUDGET_SPENT] * len(jobs))
    queue = deque(range(len(jobs)))
    threads = [threading.Thread(target=_drain, args=(w, jobs, queue, outcome, sample_timeout_s, deadline),
                                name=f"hfllamarl-grader-{k}", daemon=True)
               for k, w in enumerate(workers[: max(len(jobs), 1)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0) + _JOIN_MARGIN_S)
    # A thread still alive here is inside a call past its timeout (which Sandbox does not do): what it
    # has not answered, and what no thread took, keeps the BUDGET_SPENT it started with.
    return outcome


def _drain(worker: Any, jobs: Sequence[tuple], queue: deque, outcome: BatchOutcome, sample_timeout_s: float,
           deadline: float) -> None:
    """One thread: takes checks from ``queue`` until it is empty, each bounded as the module says."""
    settled = False  # the worker answered this thread's last call: no replacement can be booting
    while True:
        try:
            index = queue.popleft()
        except IndexError:
            return
        if not settled:
            _wait_until_ready(worker, deadline)
        remaining = deadline - time.monotonic()
        if remaining < MIN_CALL_S:
            continue  # stays BUDGET_SPENT
        budget = min(sample_timeout_s, remaining)
        settled = False
        try:
            outcome.results[index] = worker.call(*jobs[index], timeout=budget)
            outcome.failures[index] = None
            settled = True
        except SandboxTimeout:
            # cut short by the deadline only when it left the check well under its own bound (a thread's
            # wait for its worker eats a little of the last check's share on a loaded machine)
            cut = budget < _CUT_SHORT_FRACTION * sample_timeout_s
            outcome.failures[index] = BUDGET_SPENT if cut else SAMPLE_TIMEOUT
        except SandboxError:
            outcome.failures[index] = WORKER_ERROR


def _wait_until_ready(worker: Any, deadline: float) -> None:
    """A worker may be booting a replacement for one killed after a timeout or crash, in this call or an
    earlier one (about a second): wait for it here (before a thread's first check and after a failed
    one), within the batch's deadline, so its start is not charged to the next check's own timeout.
    Workers without ``wait_ready`` are not waited for. The wait runs in a helper thread joined with the
    deadline's timeout: ``wait_ready`` may first queue behind another reward call's check on the same
    worker, and this call must not wait past its deadline for that."""
    wait_ready = getattr(worker, "wait_ready", None)
    remaining = deadline - time.monotonic()
    if wait_ready is None or remaining <= 0:
        return

    def wait() -> None:
        try:
            wait_ready(remaining)
        except SandboxError:
            pass  # the next call reports it as an error of its own

    helper = threading.Thread(target=wait, name="hfllamarl-grader-ready", daemon=True)
    helper.start()
    helper.join(remaining)
