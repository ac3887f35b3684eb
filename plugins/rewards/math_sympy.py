"""Reward ``math_sympy``: 1.0 if a completion's final answer equals the gold answer, else 0.0.

The gold answer is the dataset's ``answer`` column, a LaTeX-ish string as in MATH / MATH-500
(``\\frac{14}{3}``, ``(3, \\frac{\\pi}{2})``, ``x \\in [-2,7]``, ``\\text{(C)}``, ``90^\\circ``).

Grading, per completion:

1. Extract the answer the completion commits to (``_answer.extract_answer``): the content
   of the last ``\\boxed{...}`` / ``\\fbox{...}`` (boxes side by side read as one set/tuple
   answer); with no box at all, the text after the last "answer is" / "answer:", else the last
   ``$...$`` (``$1,000`` is an amount), else a completion that is only an answer, else the last
   number of its end. An unclosed last box (truncated generation) is no answer; chat tokens are
   stripped first.
2. Normalise both sides (:func:`normalize_answer`): ``\\dfrac``, ``\\left``, spacing, units in
   ``\\text{}`` or as words after an amount, ``\\$``, ``%``, degrees, thousands separators, ``x = 3``, choice letters ...
3. Decide cheaply in this process when possible: equal strings; two plain numbers (exact
   rationals, relative tolerance 1e-6); a choice letter or a word as gold.
4. Otherwise ask math-verify (LaTeX parser only) and sympy in a sandboxed worker process
   (:mod:`._sandbox`): symbolic equality, tuples, intervals, unordered sets, matrices.

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
from ._sandbox import SandboxError, SandboxTimeout, SandboxWorker

__all__ = [
    "extract_answer", "math_sympy", "normalize_answer", "reset_stats", "shutdown", "stats",
    "warmup",
]

SAMPLE_BUDGET_S = 1.0
CALL_BUDGET_S = 2.0
REL_TOL = Fraction(1, 10**6)
WORKED_SOLUTION_CHARS = 200  # a longer gold with a box is a worked solution: its final box is the answer

# ------------------------------------------------------------------------ normalisation

_SPACING_RE = re.compile(r"\\\\|\\[!,;: ]|\\q?quad(?![A-Za-z])|~")
_SIZING_RE = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
_UNIT_TAIL_RE = re.compile(
    r"(?<=[\d})])\s*\\(?:text|textrm|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?)?\s*$"
)
_TEXT_WRAP_RE = re.compile(
    r"\\(?:text|textrm|textbf|textit|textnormal|mbox|mathrm|mathbf|mathit)\s*\{([^{}]*)\}"
)
_WHITESPACE_RE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])|\s+")
_SHORT_FRAC_RE = re.compile(r"\\frac(\d)(\d)|\\frac(\d)\{|\\frac\{([^{}]*)\}(\d)")
_SHORT_SQRT_RE = re.compile(r"\\sqrt(\d)")
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?(?:=|\\in(?![A-Za-z]))")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_COMMA_RE = re.compile(r"-?(?:0,\d+|\d{4,},\d{1,2})")  # "1,2" stays a pair
_CHOICE_RE = re.compile(r"\(?([A-H])\)?")
_INT_RATIO_RE = re.compile(r"(-?\d+)/(\d+)")
_WORDS_RE = re.compile(r"[A-Za-z]{2,}(?: [A-Za-z]+)*")
# a plain amount followed by unit or count words: "28 percent", "12 apples", "5 square feet"
_AMOUNT_WORDS_RE = re.compile(
    r"([-+]?\d[\d,]*(?:\.\d+)?%?|[-+]?\d+/\d+|\\frac\{\d+\}\{\d+\})\s*((?:[A-Za-z]{2,}\.?\s*){1,4})"
)
_MATH_WORDS = frozenset(
    "pi sqrt and or times plus minus over divided squared cubed root ln log sin cos tan cot sec csc "
    "exp mod infty inf to".split()
)
_REPLACEMENTS = (
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\displaystyle", ""), ("**", "^"),
    ("\\$", ""), ("\\textdollar", ""), ("$", ""), ("\\%", ""), ("%", ""), ("{,}", ","),
    ("^{\\circ}", ""), ("^\\circ", ""), ("\\circ", ""), ("\\degree", ""), ("°", ""),
)


def _fix_short_frac(m: re.Match) -> str:
    if m.group(1):
        return "\\frac{%s}{%s}" % (m.group(1), m.group(2))
    if m.group(3):
        return "\\frac{%s}{" % m.group(3)
    return "\\frac{%s}{%s}" % (m.group(4), m.group(5))


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer, for cheap equality and for parsing.

    Examples: ``\\dfrac{1}{2}`` -> ``\\frac{1}{2}``; ``1,234`` -> ``1234``; ``90^\\circ`` -> ``90``;
    ``x = 3`` -> ``3``; ``\\text{(C)}`` -> ``C``; ``15\\mbox{ cm}^2`` -> ``15``; ``3/4`` ->
    ``\\frac{3}{4}``; ``\\left( 3, \\frac{\\pi}{2} \\right)`` -> ``(3,\\frac{\\pi}{2})``.
    """
    s = answer.strip()
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = _SIZING_RE.sub("", s)
    s = _SPACING_RE.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s)
    for _ in range(3):  # units after a number: "5 \text{ cm}^2", "\$18 \text{ dollars}"
        s, n = _UNIT_TAIL_RE.subn("", s)
        if not n:
            break
    for _ in range(3):  # remaining \text{...}: keep the words
        s, n = _TEXT_WRAP_RE.subn(lambda m: m.group(1), s)
        if not n:
            break
    s = s.strip().rstrip(".").strip()
    if s.endswith("\\") and not s.endswith("\\\\"):  # a stray trailing backslash ("185\\")
        s = s[:-1].rstrip()
    amount = _AMOUNT_WORDS_RE.fullmatch(s)
    if amount and not _MATH_WORDS.intersection(w.rstrip(".").lower() for w in amount.group(2).split()):
        s = amount.group(1)
    if _WORDS_RE.fullmatch(s):  # a word answer ("Evelyn", "odd"): case-insensitive
        return s.lower()
    spaced_comma = ", " in answer  # "32, 349" is a pair, "32,349" a thousands separator
    decimal_comma = _DECIMAL_COMMA_RE.fullmatch(s)  # "1000,99", "0,111": a decimal comma
    if decimal_comma:
        s = s.replace(",", ".")
    s = _WHITESPACE_RE.sub(lambda m: m.group(1) + " " if m.group(1) else "", s)
    s = _SHORT_FRAC_RE.sub(_fix_short_frac, s)
    s = _SHORT_SQRT_RE.sub(r"\\sqrt{\1}", s)
    assignment = _ASSIGNMENT_RE.match(s)
    if assignment and "=" not in s[assignment.end() :]:  # not "a=1,b=2"
        s = s[assignment.end() :]
    if not spaced_comma and _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = s.lstrip("+")
    choice = _CHOICE_RE.fullmatch(s)
    if choice:
        return choice.group(1)
    ratio = _INT_RATIO_RE.fullmatch(s)
    if ratio:
        return "\\frac{%s}{%s}" % ratio.groups()
    return s


# ------------------------------------------------------------------------- equivalence

_DECIMAL_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION_RE = re.compile(r"(-?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}")


def _as_number(s: str) -> Fraction | None:
    """Exact value of a plain decimal or integer fraction (no exponents: no huge powers)."""
    if len(s) > 200:
        return None
    if _DECIMAL_RE.fullmatch(s):
        return Fraction(s)
    m = _FRACTION_RE.fullmatch(s)
    if m and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) else value
    return None


def numbers_close(a: Fraction, b: Fraction) -> bool:
    """Equal: exactly when both are integers (1048575 is not 2^20), else within a relative
    tolerance of ``REL_TOL`` (0.333333 is 1/3)."""
    if a == b or (a.denominator == 1 and b.denominator == 1):
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def _cheap_verdict(gold: str, pred: str) -> bool | None:
    """Verdict from string/number checks alone, or None when sympy is needed."""
    if gold == pred:
        return True
    if not pred:
        return False
    g, p = _as_number(gold), _as_number(pred)
    if g is not None and p is not None:
        return numbers_close(g, p)
    if _CHOICE_RE.fullmatch(gold) or _WORDS_RE.fullmatch(gold):
        return False  # a choice letter or a word: only an equal string matches
    return None


@functools.lru_cache(maxsize=512)
def _parse_latex(text: str) -> tuple:
    """Parses with math-verify's LaTeX grammar only (runs in the worker)."""
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return tuple(parse("\\boxed{" + text + "}", extraction_config=config, parsing_timeout=None))


def _numeric_close(gold: Any, pred: Any) -> bool:
    """Real constant expressions compared by value, as :func:`numbers_close` does."""
    import sympy

    if not (isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr)):
        return False
    if not (gold.is_number and pred.is_number):
        return False
    g, p = gold.evalf(30), pred.evalf(30)
    if not (g.is_Float and p.is_Float):  # complex, infinite or not evaluable
        return False
    try:
        return numbers_close(Fraction(str(g)), Fraction(str(p)))
    except (ValueError, ZeroDivisionError):
        return False


def _worker_equivalent(gold: str, pred: str, gold_raw: str, pred_raw: str) -> bool:
    """Symbolic equivalence by math-verify, then a numeric check (runs in the worker)."""
    from math_verify import verify

    golds = _parse_latex(gold) or _parse_latex(gold_raw)
    preds = _parse_latex(pred) or _parse_latex(pred_raw)
    if not golds or not preds:
        return False
    if verify(list(golds), list(preds), timeout_seconds=None, allow_set_relation_comp=True):
        return True
    if _numeric_close(golds[0], preds[0]):
        return True
    if "=" in gold_raw + pred_raw and (gold, pred) != (gold_raw, pred_raw):
        # an equation in another form ("y=2x+3" vs "2x-y+3=0"): normalising dropped "y="
        golds, preds = _parse_latex(gold_raw), _parse_latex(pred_raw)
        return bool(golds and preds) and verify(list(golds), list(preds), timeout_seconds=None)
    return False


def _worker_warmup() -> None:
    """Heavy imports and parser set-up, in the worker before it reports ready."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # no "timeout disabled" notes
    _worker_equivalent("\\frac{1}{2}", "\\sqrt{x}", "", "")


# ------------------------------------------------------------------------ reward function

_WORKER = SandboxWorker(_worker_equivalent, warmup=_worker_warmup)
_LOCK = threading.Lock()
_STATS = {"calls": 0, "samples": 0, "timeouts": 0, "worker_errors": 0}
_STARTED = [False]  # whether a worker has ever been ready (first start is not budgeted)
atexit.register(_WORKER.close)


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
        gold_raw = str(gold).strip()
        if len(gold_raw) > WORKED_SOLUTION_CHARS and ("\\boxed" in gold_raw or "\\fbox" in gold_raw):
            # a worked solution as gold: its boxed answer
            gold_raw = (final_boxes(gold_raw) or gold_raw).strip()
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
