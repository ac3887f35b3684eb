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
4. Otherwise ask math-verify (LaTeX parser only) and sympy in a sandboxed worker process
   (:mod:`hfllamarl.runtime.sandbox`: a fresh isolated process per call): numbers by value
   under the same rules, then symbolic equality, tuples, intervals, unordered sets, matrices (elementwise, in order, for decimals). An interval or set
   as gold is not matched by an inequality (math-verify's rule); the other way round it is.

Security: model text is never evaluated as Python. It goes only through
``math_verify.parse`` with ``LatexExtractionConfig`` (the ANTLR LaTeX grammar of
latex2sympy2_extended builds sympy objects directly); ``ExprExtractionConfig``, ``sympify``
and ``parse_expr`` are not used, as they call ``eval``.

Time: each call returns within ``CALL_BUDGET_S`` (2 s) plus a few milliseconds, apart from
the one-time start of the worker on the first call that needs it (about 1 s; call
:func:`warmup` at start-up to take it out of the training loop). One sample gets at most
``SAMPLE_BUDGET_S`` (1 s) of worker time; a sample that runs out of time scores 0.0 and is
counted in ``stats()["timeouts"]``.

Counters for logging: ``math_sympy.stats()`` (also ``stats()`` in this module) returns
``{"calls", "samples", "timeouts", "worker_errors", "worker_starts"}`` totals since import.
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
from hfllamarl.runtime.sandbox import Sandbox, SandboxError, SandboxTimeout

__all__ = [
    "configure", "extract_answer", "math_sympy", "normalize_answer", "reset_stats", "shutdown", "stats",
    "warmup",
]

SAMPLE_BUDGET_S = 1.0
CALL_BUDGET_S = 2.0
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
    """Symbolic equivalence by math-verify, then a numeric check (runs in the worker)."""
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

_WORKER = Sandbox(f"{__name__}:_worker_equivalent", warmup=f"{__name__}:_worker_warmup", isolation="namespaces",
                  parallel=min(2, os.cpu_count() or 1), memory_mb=4096)


def configure(isolation: str = "namespaces") -> None:
    """Chooses the grader's sandbox isolation ("namespaces", or the weaker opt-in "process"); restarts it."""
    global _WORKER
    if isolation != _WORKER.requested_isolation:
        _WORKER.close()
        _WORKER = Sandbox(_WORKER.fn, warmup=_WORKER.warmup, isolation=isolation, parallel=_WORKER.parallel,
                          memory_mb=4096)
        _STARTED[0] = False


_LOCK = threading.Lock()
_STATS = {"calls": 0, "samples": 0, "timeouts": 0, "worker_errors": 0}
_STARTED = [False]  # whether a worker has ever been ready (first start is not budgeted)
atexit.register(lambda: _WORKER.close())


def stats() -> dict[str, int]:
    """Totals since import: reward calls, samples scored, samples that ran out of time
    (scored 0.0), worker failures (scored 0.0) and worker processes started."""
    with _LOCK:
        return {**_STATS, "worker_starts": _WORKER.starts}


def reset_stats() -> None:
    """Sets all counters of :func:`stats` (but ``worker_starts``) to zero."""
    with _LOCK:
        for key in _STATS:
            _STATS[key] = 0


def warmup(timeout: float | None = None) -> None:
    """Starts the worker and waits until it is ready, so the first reward call is fast.

    Args:
        timeout: Seconds to wait; the worker's ``startup_timeout`` (60 s) by default.

    Raises:
        RuntimeError: The worker did not start in time or died while starting.
    """
    timeout = _WORKER.startup_timeout if timeout is None else timeout
    try:
        ready = _WORKER.wait_ready(timeout)
    except SandboxError as exc:
        raise RuntimeError(f"math_sympy's worker process failed to start: {exc}") from exc
    if not ready:
        raise RuntimeError(f"math_sympy's worker process was not ready within {timeout:.0f} s.")
    _STARTED[0] = True


def shutdown() -> None:
    """Stops the worker process (a later call starts a new one)."""
    _WORKER.close()


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
        One score per completion; None where the gold answer is None or blank.

    Raises:
        ValueError: The dataset has no ``answer`` column.
    """
    call_deadline = time.monotonic() + CALL_BUDGET_S
    answers = gold_answers(kwargs, len(completions), "math_sympy")
    scores: list[float | None] = [None] * len(completions)
    pending: dict[tuple[str, str, str, str], list[int]] = {}  # same pair -> graded once
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
        if verdict is None:
            pending.setdefault((gold_norm, pred_norm, gold_raw, pred_raw), []).append(i)
        else:
            scores[i] = 1.0 if verdict else 0.0

    timeouts = errors = 0
    if pending and not _STARTED[0]:
        started = time.monotonic()
        warmup()
        call_deadline += time.monotonic() - started  # the one-time start is not budgeted
    for args, indices in pending.items():
        budget = min(SAMPLE_BUDGET_S, call_deadline - time.monotonic())
        try:
            if budget < 0.05:
                raise SandboxTimeout("call budget spent")
            equal = bool(_WORKER.call(*args, timeout=budget))
        except SandboxTimeout:
            timeouts += len(indices)
            continue
        except SandboxError:
            errors += len(indices)
            continue
        for i in indices:
            scores[i] = 1.0 if equal else 0.0

    with _LOCK:
        _STATS["calls"] += 1
        _STATS["samples"] += sum(s is not None for s in scores)
        _STATS["timeouts"] += timeouts
        _STATS["worker_errors"] += errors
    return scores


math_sympy.stats = stats  # type: ignore[attr-defined]
math_sympy.reset_stats = reset_stats  # type: ignore[attr-defined]
math_sympy.warmup = warmup  # type: ignore[attr-defined]
math_sympy.shutdown = shutdown  # type: ignore[attr-defined]
math_sympy.configure = configure  # type: ignore[attr-defined]
