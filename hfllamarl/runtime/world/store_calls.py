"""Calls to the job's store that never block their caller past a bound.

A store whose host is frozen accepts connections and never answers, and a store on a crowded machine answers
late: no store call may block the watchdog or a failing rank on it (`timed`), and a look at the store that
overran its bound must not make the next look time out too (`SingleFlight`).
"""

from __future__ import annotations

import threading
import time

STORE_CALL_S = 4.0  # the longest one look at the store may take


def timed(fn, timeout_s: float):
    """`fn()`, or TimeoutError after `timeout_s` (the helper thread is left to finish or fail on its own)."""
    return SingleFlight(fn, "hfllamarl-store-call")(timeout_s)


class SingleFlight:
    """`fn()` on a helper thread, one call at a time: a caller that finds the last call still running waits for
    that call (up to its own timeout) instead of starting another behind it.

    A call that overran its caller's timeout still holds what it holds (the shared store client) until the store
    answers it. Starting a new call at every look would queue each behind the last, so that every look times out
    while the store answers them all, only late: a slow store would read as a silent one. Waiting for the call in
    flight, a look times out only if the store has not answered for that long.
    """

    def __init__(self, fn, name: str):
        self._fn, self._name = fn, name
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self._box: dict = {}
        self.answered_at: float | None = None  # time.monotonic() when a call last returned (not raised)

    def __call__(self, timeout_s: float):
        with self._guard:
            if self._thread is None or not self._thread.is_alive():  # (a finished call's result was for its caller)
                box: dict = {}
                self._thread = threading.Thread(target=self._run, args=(box,), name=self._name, daemon=True)
                self._box = box
                self._thread.start()
            thread, box = self._thread, self._box
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"the job's store did not answer within {timeout_s:.0f} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _run(self, box: dict) -> None:
        try:
            box["value"] = self._fn()
            self.answered_at = time.monotonic()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
