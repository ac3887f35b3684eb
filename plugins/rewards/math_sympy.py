"""Reward ``math_sympy``: 1.0 if a completion's final answer equals the gold answer, else 0.0.

The gold answer is the dataset's ``answer`` column, a LaTeX-ish string as in MATH / MATH-500
(``\\frac{14}{3}``, ``(3, \\frac{\\pi}{2})``, ``x \\in [-2,7]``, ``\\text{(C)}``, ``90^\\circ``).

Grading, per completion:

1. Extract the answer the completion commits to (``_answer.extract_answer``): the content
   of the last ``\\boxed{...}`` / ``\\fbox{...}`` (boxes side by side, or with a few words ending
   in "and"/"or" between them, read as one set/tuple answer), unless an answer statement
   ("The final answer is $10,455$") comes after it; with no box, the text after the last
   "answer is" / "answer:" (a sentence in words: its one number); else a completion that is only
   an answer (one short line, or one LaTeX environment); else the last ``$...$`` or the last
   number of its end (``1,000.99m²``, ``2,74 €``), whichever comes later. An unclosed last box
   (truncated generation) is no answer; chat tokens are stripped first. The gold is read
   likewise when it is a worked solution (:func:`gold_text`).
2. Normalise both sides (:func:`normalize_answer`): ``\\dfrac``, ``\\left``, spacing, units in
   ``\\text{}`` or as words after an amount, ``\\$``, ``%``, degrees, thousands separators, ``x = 3``,
   ``x = 1, x = -2`` (one left side, several values), "and"/"or" lists, choice letters ...
3. Decide cheaply in this process when possible: equal strings; two plain numbers
   (:mod:`._numbers`: exact values exactly, a decimal within 1e-6 or rounded to its own digits
   when the other side has no finite decimal form); numbers in a base; a choice letter or a word
   as gold.
4. Otherwise grade an answer whose structure is past what any check should evaluate wrong, 0.0, here
   (:mod:`._structure`: brackets nested past 12, a power tower past 4 levels, an exponent or a sum's bound past
   10^5, a factorial of a number past 10^4 or of a factorial; each raised to the gold's own figure): a policy must
   not earn an unscored pass (advantage 0) by writing what the check cannot finish in time.
5. Otherwise ask math-verify (LaTeX parser only) and sympy in a sandboxed worker process
   (:mod:`hfllamarl.sandbox.client`: a fresh isolated process per call): numbers by value
   under the same rules, then symbolic equality, tuples, intervals, unordered sets, matrices (elementwise, in order, for decimals). An interval or set
   as gold is not matched by an inequality (math-verify's rule); the other way round it is.

Security: model text is never evaluated as Python. It goes only through
``math_verify.parse`` with ``LatexExtractionConfig`` (the ANTLR LaTeX grammar of
latex2sympy2_extended builds sympy objects directly); ``ExprExtractionConfig``, ``sympify``
and ``parse_expr`` are not used, as they call ``eval``.

Time: the checks that need the worker run on ``workers`` sandboxed worker processes at once (one
thread driving each). A call's budget scales with its batch: ``sample_budget_s`` times the number
of distinct (gold, answer) pairs that need a worker, divided by ``workers``, plus
``sample_timeout_s`` (the last check may start just before the end), plus the one-time start of the workers on the first call that needs them
(about 1 s; call :func:`warmup` at start-up to take it out of the training loop). One check gets at
most ``sample_timeout_s`` of worker time, so a check that would run long (``\\sum_{k=1}^{9999} k^{k^{2}}``,
which step 4's rules let through) ends at its own timeout. A completion whose check did not finish (its own
timeout, the call's budget spent, a worker crash) is unscored: its score is None, which leaves it out of its
group's baseline with advantage 0 (TRL's NaN), never 0.0. A call with more than 1 % of its completions unscored logs a
warning (logger ``hfllamarl.plugins.rewards.math_sympy``) saying how many, why, and which setting
raises the budget.

Settings (:func:`configure`, also ``math_sympy.configure``; call it before training, on every rank):

- ``sample_timeout_s`` (2.0): seconds one check may take at most. Most checks take 5-20 ms, but
  a few legitimate ones (an equation in three unknowns, first seen by a worker) take close to a
  second on a loaded 2-core machine.
- ``sample_budget_s`` (0.25): seconds per check the call's budget allows on average; the worst
  case of one call is about ``sample_budget_s * checks / workers + sample_timeout_s`` seconds,
  which must stay well below the job's ``collective_timeout_s``.
- ``workers`` (``min(os.cpu_count(), 4)``): worker processes (about 65 MB each once started), per trainer rank.

Counters for logging: ``math_sympy.stats()`` (also ``stats()`` in this module) returns
``{"calls", "samples", "unscored", "timeouts", "worker_errors", "excessive", "worker_starts"}`` totals since
import (``samples``: completions scored; ``excessive``: answers graded wrong for their structure (step 4);
``unscored``: completions left unscored because their
check did not finish, of which ``timeouts`` ran out of time and ``worker_errors`` met a failed
worker). The trainer logs them every step as ``rewards/math_sympy/<key>``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
import time
from fractions import Fraction
from typing import Any

from ._answer import (
    MAX_ANSWER_CHARS,
    completion_text,
    extract_answer,
    final_boxes,
    gold_answers,
    is_missing,
)
from ._numbers import as_number, base_number_verdict, numbers_close, rounded_to_own_digits
from ._normalize import CHOICE_RE, WORDS_RE, normalize_answer, unescape_commands
from hfllamarl.sandbox import Sandbox, SandboxError
from ._batch import BUDGET_SPENT, WORKER_ERROR, run_checks
from ._structure import excessive

__all__ = [
    "configure", "extract_answer", "math_sympy", "normalize_answer", "reset_stats", "shutdown", "stats",
    "warmup",
]

logger = logging.getLogger(__name__)

UNSCORED_WARN_FRACTION = 0.01  # more unscored completions than this in one call: a warning
WORKED_SOLUTION_CHARS = 200  # a longer gold is a worked solution: the answer it commits to is the gold

# ------------------------------------------------------------------------- equivalence

def _cheap_verdict(gold: str, pred: str) -> bool | None:
    """Verdict from string/number checks alone, or None when sympy is needed."""
    if gold == pred:
        return True
    if not pred:
        return False
    base = base_number_verdict(gold, pred)
    if base is not None:
        return base
    g, p = as_number(gold), as_number(pred)
    if g is not None and p is not None:
        return numbers_close(g[0], p[0], g[1], p[1]) or (p[1] and rounded_to_own_digits(g[0], pred))
    if CHOICE_RE.fullmatch(gold) or WORDS_RE.fullmatch(gold):
        return False  # a choice letter or a word: only an equal string matches
    return None


@functools.lru_cache(maxsize=512)
def _parse_latex(text: str) -> tuple:
    """Parses with math-verify's LaTeX grammar only (runs in the worker)."""
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return tuple(parse("\\boxed{" + text + "}", extraction_config=config, parsing_timeout=None))


def _numeric_value(x: Any) -> tuple[Fraction, bool]:
    """(value, written as a decimal) of a real sympy number: exact for a rational, the digits it
    was written with for a decimal, 30 digits for anything else."""
    import sympy

    if x.is_Rational:
        return Fraction(int(x.p), int(x.q)), False
    if isinstance(x, sympy.Float):
        return Fraction(_decimal_text(x)), True
    return Fraction(str(x.evalf(30))), x.has(sympy.Float)


def _numeric_close(gold: Any, pred: Any) -> bool | None:
    """Two real numbers compared by :mod:`._numbers`' rules (exact values exactly, a decimal
    within a tolerance or rounded to its own digits), or None when either is not a real number."""
    import sympy

    if not (isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr) and gold.is_number and pred.is_number):
        return None
    g_approx, p_approx = gold.evalf(30), pred.evalf(30)
    if not (g_approx.is_Float and p_approx.is_Float):  # complex, infinite or not evaluable
        return None
    if gold.is_Rational and pred.is_Rational:
        return bool(gold == pred)
    try:
        (g, g_decimal), (p, p_decimal) = _numeric_value(gold), _numeric_value(pred)
    except (ValueError, ZeroDivisionError, OverflowError):  # a value with no decimal digits to read
        return None
    if not g_decimal and not p_decimal:  # exact values, one irrational: equal to 25 digits
        return abs(g - p) <= Fraction(1, 10**25) * max(abs(g), abs(p))
    irrational = not (gold.is_Rational or g_decimal) or not (pred.is_Rational or p_decimal)
    if numbers_close(g, p, g_decimal, p_decimal, irrational):
        return True
    return p_decimal and isinstance(pred, sympy.Float) and rounded_to_own_digits(
        g, _decimal_text(pred), irrational=not gold.is_Rational)


def _ordered_parts(value: Any) -> tuple[tuple, list] | None:
    """(kind, elements) of an interval, a tuple or a matrix, whose elements compare in order."""
    import sympy

    if isinstance(value, sympy.Interval):
        return ("interval", value.left_open, value.right_open), [value.start, value.end]
    if isinstance(value, sympy.Tuple):
        return ("tuple", len(value)), list(value)
    if isinstance(value, sympy.MatrixBase):
        return ("matrix", value.shape), list(value)
    return None


def _decimal_text(value: Any) -> str:
    """The digits a parsed decimal was written with, as far as its value shows (``2.6667``)."""
    import sympy

    text = str(value)
    if isinstance(value, sympy.Float) and "." in text and "e" not in text.lower():
        return text.rstrip("0")
    return text


def _elementwise_close(gold: Any, pred: Any) -> bool:
    """Intervals, tuples and matrices of the same kind whose elements are close in order, each as
    :func:`_numeric_close` says (``(0.6, 2.6667]`` for ``(\\frac{3}{5}, \\frac{8}{3}]``)."""
    g, p = _ordered_parts(gold), _ordered_parts(pred)
    if g is None or p is None or g[0] != p[0] or len(g[1]) != len(p[1]):
        return False
    return all(a == b or bool(_numeric_close(a, b)) for a, b in zip(g[1], p[1]))


def _worker_equivalent(gold: str, pred: str, gold_raw: str, pred_raw: str) -> bool:
    """Symbolic equivalence by math-verify, then a numeric check (runs in the worker).

    A check that raises has finished: the answer could not be shown equal, so it is wrong (False). Only a
    check that could not finish (out of time, out of memory, too deep, its process killed) leaves the
    completion unscored; otherwise a policy could trade a wrong answer's negative advantage for an unscored
    one's 0 by writing answers that make the parser raise.
    """
    try:
        return _equivalent(gold, pred, gold_raw, pred_raw)
    except (MemoryError, RecursionError):
        raise  # the answer is too large or deep to check: unscored, like a timeout
    except Exception:  # noqa: BLE001 - any other failure of the check on model text means "not shown equal"
        return False


def _equivalent(gold: str, pred: str, gold_raw: str, pred_raw: str) -> bool:
    from math_verify import verify

    golds = _parse_latex(gold) or _parse_latex(gold_raw)
    preds = _parse_latex(pred) or _parse_latex(pred_raw)
    if not golds or not preds:
        return False
    numeric = _numeric_close(golds[0], preds[0])
    if numeric is not None:  # two numbers: by value (math-verify rounds 1/2004! and 1/2005! to 0)
        return numeric
    if verify(list(golds), list(preds), timeout_seconds=None, allow_set_relation_comp=False):
        return True
    if _elementwise_close(golds[0], preds[0]):
        return True
    if "=" in gold_raw + pred_raw and (gold, pred) != (gold_raw, pred_raw):
        # an equation in another form ("y=2x+3" vs "2x-y+3=0"): normalising dropped "y="
        golds, preds = _parse_latex(gold_raw), _parse_latex(pred_raw)
        return bool(golds and preds) and verify(list(golds), list(preds), timeout_seconds=None)
    return False


def gold_text(gold: Any) -> str:
    """The gold answer to compare with: the ``answer`` column's text; of a worked solution
    (longer than ``WORKED_SOLUTION_CHARS``), the answer it commits to, as for a completion; of a
    gold with boxes (``\\boxed{1} papers and \\boxed{2} bins``), its final boxed answer (boxes
    side by side as one). A short gold's open box (``\\boxed{W(n) = 1``) runs to the end: gold
    answers are not truncated generations."""
    text = unescape_commands(str(gold).strip())
    if len(text) > WORKED_SOLUTION_CHARS:
        return (extract_answer(text, gold=True) or text).strip()
    if "\\boxed" not in text and "\\fbox" not in text:
        return text
    boxed = final_boxes(text, gold=True)
    if boxed is not None:
        return boxed.strip()
    if text.startswith(("\\boxed{", "\\fbox{")):
        return text[text.index("{") + 1 :].strip()
    return text


def _worker_warmup() -> None:
    """Heavy imports and parser set-up, in the worker before it reports ready."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # no "timeout disabled" notes
    _worker_equivalent("\\frac{1}{2}", "\\sqrt{x}", "", "")


# ------------------------------------------------------------------------ reward function

_SETTINGS: dict[str, Any] = {
    "sample_timeout_s": 2.0, "sample_budget_s": 0.25, "workers": max(1, min(os.cpu_count() or 1, 4)),
    "isolation": "namespaces",
}


def _make_workers(n: int) -> list:
    """The sandbox the checks run on, once per grading thread: the only place it is built (one server
    taking ``n`` concurrent calls, each in a fresh isolated process)."""
    sandbox = Sandbox(f"{__name__}:_worker_equivalent", warmup=f"{__name__}:_worker_warmup",
                      isolation=_SETTINGS["isolation"], parallel=n, memory_mb=4096)
    return [sandbox] * n


_LOCK = threading.Lock()
_WORKERS: list = _make_workers(_SETTINGS["workers"])
_STATS = {"calls": 0, "samples": 0, "unscored": 0, "timeouts": 0, "worker_errors": 0, "excessive": 0}
_RETIRED_STARTS = [0]  # worker starts of workers replaced by configure()
_STARTED = [False]  # whether the workers have ever been ready (their first start is not budgeted)


def _distinct_workers() -> list:
    """Each worker object once (one sandbox taking concurrent calls may fill every slot)."""
    return list({id(w): w for w in _WORKERS}.values())


def _close_workers() -> None:
    for worker in _distinct_workers():
        worker.close()


atexit.register(_close_workers)


def configure(*, sample_timeout_s: float | None = None, sample_budget_s: float | None = None,
              workers: int | None = None, isolation: str | None = None) -> dict[str, Any]:
    """Sets the grader's time budget and worker count (see the module docstring); omitted ones stay.

    Args:
        sample_timeout_s: Seconds one check may take at most (a pathological answer ends there).
        sample_budget_s: Seconds per check a call's budget allows on average
            (``sample_budget_s * checks / workers + sample_timeout_s``).
        workers: Worker processes grading at once; changing it stops the current workers (the
            next call starts the new ones).
        isolation: The sandbox's isolation, ``"namespaces"`` (default) or the weaker opt-in
            ``"process"`` for kernels that refuse user namespaces (see :mod:`hfllamarl.sandbox.client`);
            changing it restarts the workers.

    Returns:
        The settings now in force.

    Raises:
        ValueError: A setting is not a positive number (``workers``: a positive integer).
    """
    for name, value in (("sample_timeout_s", sample_timeout_s), ("sample_budget_s", sample_budget_s)):
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ValueError(f"math_sympy.configure: {name} must be a positive number of seconds, got {value!r}.")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"math_sympy.configure: workers must be a positive integer, got {workers!r} "
                         f"(this machine has {os.cpu_count()} cores).")
    if isolation is not None and isolation not in ("namespaces", "process"):
        raise ValueError(f"math_sympy.configure: isolation must be 'namespaces' or 'process', got {isolation!r}.")
    with _LOCK:
        if sample_timeout_s is not None:
            _SETTINGS["sample_timeout_s"] = float(sample_timeout_s)
        if sample_budget_s is not None:
            _SETTINGS["sample_budget_s"] = float(sample_budget_s)
        changed = (workers is not None and workers != _SETTINGS["workers"]) or (
            isolation is not None and isolation != _SETTINGS["isolation"])
        if changed:
            _close_workers()
            _RETIRED_STARTS[0] += sum(w.starts for w in _distinct_workers())
            _SETTINGS["workers"] = workers or _SETTINGS["workers"]
            _SETTINGS["isolation"] = isolation or _SETTINGS["isolation"]
            _WORKERS[:] = _make_workers(_SETTINGS["workers"])
            _STARTED[0] = False
        return dict(_SETTINGS)


def stats() -> dict[str, int]:
    """Totals since import: reward calls, completions scored, completions left unscored (their check
    did not finish), checks that ran out of time, checks whose worker failed, and worker processes
    started."""
    with _LOCK:
        starts = _RETIRED_STARTS[0] + sum(w.starts for w in _distinct_workers())
        return {**_STATS, "worker_starts": starts}


def reset_stats() -> None:
    """Sets all counters of :func:`stats` (but ``worker_starts``) to zero."""
    with _LOCK:
        for key in _STATS:
            _STATS[key] = 0


def warmup(timeout: float | None = None) -> None:
    """Starts the workers (all at once) and waits until they are ready, so the first reward call is fast.

    Args:
        timeout: Seconds to wait; the workers' ``startup_timeout`` (60 s) by default.

    Raises:
        RuntimeError: A worker did not start in time or died while starting.
    """
    workers = _distinct_workers()
    timeout = workers[0].startup_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.start()  # they boot in parallel
    for worker in workers:
        try:
            ready = worker.wait_ready(max(deadline - time.monotonic(), 0.0))
        except SandboxError as exc:
            raise RuntimeError(f"math_sympy's worker process failed to start: {exc}") from exc
        if not ready:
            raise RuntimeError(f"math_sympy's worker processes were not ready within {timeout:.0f} s.")
    _STARTED[0] = True


def shutdown() -> None:
    """Stops the worker processes (a later call starts new ones, outside its budget)."""
    _close_workers()
    _STARTED[0] = False


def math_sympy(
    prompts: list | None, completions: list, completion_ids: list | None = None, **kwargs: Any
) -> list[float | None]:
    """Scores each completion 1.0 if its final answer equals the gold ``answer``, else 0.0.

    Args:
        prompts: The prompts (unused).
        completions: Strings, or chat message lists (the last assistant message is graded).
        completion_ids: Token ids (unused).
        **kwargs: Dataset columns; ``answer`` (gold LaTeX answers) is required. Other
            columns and trainer extras (``trainer_state``, ...) are ignored.

    Returns:
        One score per completion; None where the gold answer is None or blank, or where the check
        did not finish (out of time, a failed worker: see the module docstring).

    Raises:
        ValueError: The dataset has no ``answer`` column.
    """
    answers = gold_answers(kwargs, len(completions), "math_sympy")
    scores: list[float | None] = [None] * len(completions)
    pending: dict[tuple[str, str, str, str], list[int]] = {}  # same pair -> graded once
    refused = 0
    for i, (completion, gold) in enumerate(zip(completions, answers)):
        if is_missing(gold):
            continue
        scores[i] = 0.0
        pred_raw = extract_answer(completion_text(completion))
        if pred_raw is None or not pred_raw.strip() or len(pred_raw) > MAX_ANSWER_CHARS:
            continue
        gold_raw = gold_text(gold)
        gold_norm, pred_norm = normalize_answer(gold_raw), normalize_answer(pred_raw)
        verdict = _cheap_verdict(gold_norm, pred_norm)
        if verdict is None and excessive(pred_norm, gold_norm):
            refused += 1  # wrong: no check should have to evaluate it (the policy's free pass otherwise)
        elif verdict is None:
            pending.setdefault((gold_norm, pred_norm, gold_raw, pred_raw), []).append(i)
        else:
            scores[i] = 1.0 if verdict else 0.0
    timeouts = errors = 0
    if pending:
        timeouts, errors, budget_spent = _grade_pending(pending, scores)
        _warn_if_unscored(len(completions), timeouts, errors, budget_spent)
    with _LOCK:
        _STATS["calls"] += 1
        _STATS["samples"] += sum(s is not None for s in scores)
        _STATS["unscored"] += timeouts + errors
        _STATS["timeouts"] += timeouts
        _STATS["worker_errors"] += errors
        _STATS["excessive"] += refused
    return scores


def _grade_pending(pending: dict[tuple, list[int]], scores: list[float | None]) -> tuple[int, int, bool]:
    """Runs the sandboxed checks and writes their verdicts into ``scores``; a check that did not
    finish makes its completions None. Returns (completions out of time, completions whose worker
    failed, whether the call's budget ran out)."""
    if not _STARTED[0]:
        warmup()  # before the deadline is set: the one-time start is not budgeted
    with _LOCK:
        workers, settings = list(_WORKERS), dict(_SETTINGS)
    jobs = list(pending)
    # the checks' average share, plus one check's own bound: the last one may start just before the end
    budget = settings["sample_budget_s"] * len(jobs) / len(workers) + settings["sample_timeout_s"]
    outcome = run_checks(workers, jobs, sample_timeout_s=settings["sample_timeout_s"],
                         deadline=time.monotonic() + budget)
    timeouts = errors = 0
    for job, equal, failure in zip(jobs, outcome.results, outcome.failures):
        indices = pending[job]
        if failure is None:
            for i in indices:
                scores[i] = 1.0 if equal else 0.0
            continue
        for i in indices:
            scores[i] = None  # not decided: unscored, never 0.0
        if failure == WORKER_ERROR:
            errors += len(indices)
        else:
            timeouts += len(indices)
    return timeouts, errors, outcome.count(BUDGET_SPENT) > 0


def _warn_if_unscored(total: int, timeouts: int, errors: int, budget_spent: bool) -> None:
    """One warning per call when more than ``UNSCORED_WARN_FRACTION`` of its completions are unscored."""
    unscored = timeouts + errors
    if unscored <= UNSCORED_WARN_FRACTION * total:
        return
    settings = dict(_SETTINGS)
    if budget_spent:
        why = (f"the call's time budget ran out (sample_budget_s={settings['sample_budget_s']:g} s per check on "
               f"{settings['workers']} workers): raise it with math_sympy.configure(sample_budget_s=...) or "
               "workers=...")
    else:
        why = (f"single checks reached their own timeout (sample_timeout_s={settings['sample_timeout_s']:g} s): "
               "raise it with math_sympy.configure(sample_timeout_s=...) if these answers are not pathological")
    logger.warning(
        "math_sympy: %d of %d completions (%.1f %%) are unscored (reward None, left out of their groups' "
        "baselines): %d did not finish in time, %d met a failed grader worker; %s.",
        unscored, total, 100.0 * unscored / total, timeouts, errors, why)


math_sympy.stats = stats  # type: ignore[attr-defined]
math_sympy.reset_stats = reset_stats  # type: ignore[attr-defined]
math_sympy.warmup = warmup  # type: ignore[attr-defined]
math_sympy.shutdown = shutdown  # type: ignore[attr-defined]
math_sympy.configure = configure  # type: ignore[attr-defined]
