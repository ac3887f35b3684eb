"""Answers whose structure no check should have to evaluate (:func:`excessive`), decided in the trusted process.

A policy that learns that an answer the grader cannot finish in time is left unscored (advantage 0, not a wrong
answer's negative one) can write such answers when unsure. So before any check, an answer whose structure is far
past what a mathematical answer needs is graded wrong (0.0), by plain linear scans of its normalized text (at most
``MAX_ANSWER_CHARS`` characters):

- bracket nesting (``(``, ``[``, ``{``) deeper than ``MAX_DEPTH``;
- a power tower of more than ``MAX_TOWER`` levels (``x^2`` has 2, ``x^{y^{z}}`` 3);
- an exponent, or the bound of a sum or product, above ``10^MAX_EXPONENT_LOG10`` (``10^{10^{10}}``,
  ``9^{9^{9}}``, ``\\sum_{k=1}^{10^{8}}``), its value estimated from its integer literals and powers of them;
- a factorial of a number above ``10^MAX_FACTORIAL_LOG10`` (``1000000!``, ``(10^{7})!``), or of a factorial
  (``(300)!!``).

Each limit is raised to the gold answer's own figure where the gold needs more (a gold ``(2n)!!`` admits a double
factorial). Symbols cost nothing here (``x^{y^{z}}`` is cheap to compare). MATH and MATH-500's gold answers stay
within every limit (``tests/test_grader_rules.py``).
What the scans do not catch (a sum of huge powers within the limits, say) still ends at the check's own timeout,
unscored: the time bound is the backstop, these rules take the cheap attacks away from it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

__all__ = ["MAX_DEPTH", "MAX_EXPONENT_LOG10", "MAX_FACTORIAL_LOG10", "MAX_TOWER", "Structure", "excessive"]

MAX_DEPTH = 12
MAX_TOWER = 4
MAX_EXPONENT_LOG10 = 5.0  # an exponent up to 10^5: 10^{100000} takes sympy milliseconds, 10^{10^7} ten seconds
MAX_FACTORIAL_LOG10 = 4.0  # 10000! takes milliseconds, 100000! most of a second

_OPEN, _CLOSE = "([{", ")]}"
_NUMERIC_GROUP_RE = re.compile(r"(?:[\d\s+\-*/^{}().]|\\cdot|\\times)*")
_BIG_OPERATOR_RE = re.compile(r"\\(?:sum|prod)(?![A-Za-z])")


@dataclass(frozen=True)
class Structure:
    """What evaluating an answer could cost: its bracket nesting depth, tallest power tower (levels: ``x^2`` has
    2), the size of its largest exponent or big-operator bound and of its largest factorial operand (log10 of
    their values, estimated for integer literals and powers of them; 0 for symbols), and its longest run of
    factorials."""

    depth: int = 0
    tower: int = 0
    exponent: float = 0.0
    factorial: float = 0.0
    factorial_run: int = 0

    @classmethod
    def of(cls, text: str) -> "Structure":
        text = text.replace("**", "^")
        depth, deepest, match, stack = 0, 0, {}, []
        for i, ch in enumerate(text):
            if ch in _OPEN:
                depth += 1
                deepest = max(deepest, depth)
                stack.append(i)
            elif ch in _CLOSE and stack:
                depth -= 1
                match[stack.pop()] = i
        if deepest > 4 * MAX_DEPTH:  # (the scans below are quadratic at worst: not past this)
            return cls(depth=deepest)
        return _Scan(text, match).structure(deepest)


class _Scan:
    """One answer's powers, measured innermost first (an exponent's carets lie to its right)."""

    def __init__(self, text: str, match: dict):
        self.text, self.match = text, match
        self.carets = [i for i, ch in enumerate(text) if ch == "^"]
        self.levels: dict[int, int] = {}  # caret -> carets in its tower, itself included
        self.exponent: dict[int, float] = {}  # caret -> log10 of its exponent's value
        self.size: dict[int, float] = {}  # caret -> log10 of the power's value (0: symbolic base)
        for i in reversed(self.carets):
            start, end = self.span(i + 1)
            inner = [j for j in self.carets if start <= j < end]
            chained = end < len(text) and text[end] == "^" and text[i + 1] not in _OPEN  # 10^10^10: a tower
            self.levels[i] = 1 + max([self.levels[j] for j in inner] + [self.levels[end] if chained else 0])
            self.exponent[i] = max(self.log10(start, end), self.size[end] if chained else 0.0)
            scale = _log10(text[_digits_before(text, i):i])  # (a symbolic base: 0)
            self.size[i] = math.inf if self.exponent[i] > 300 else 10 ** self.exponent[i] * scale

    def span(self, i: int) -> tuple[int, int]:
        """The operand that starts at `i` (after ``^`` or ``_``): a bracketed group's inside, a command, a digit
        run or a character, as (start, end)."""
        text = self.text
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text):
            return i, i
        if text[i] in _OPEN and i in self.match:
            return i + 1, self.match[i]
        m = re.match(r"\\[A-Za-z]+|\d+", text[i:])
        return i, i + (m.end() if m else 1)

    def log10(self, start: int, end: int) -> float:
        """log10 of the largest value in text[start:end]: its integer literals and powers of them."""
        runs = [_log10(m.group(0)) for m in re.finditer(r"\d+", self.text[start:end])]
        return max(runs + [self.size[j] for j in self.carets if start <= j < end], default=0.0)

    def structure(self, depth: int) -> Structure:
        text, closing = self.text, {j: i for i, j in self.match.items()}
        bounds = [self.log10(*self.span(i + 1)) for i, ch in enumerate(text)
                  if ch == "_" and _BIG_OPERATOR_RE.search(text[max(0, i - 6):i])]
        factorial = 0.0
        for i, ch in enumerate(text):
            if ch != "!" or i == 0 or text[i - 1] == "!":
                continue
            if text[i - 1] in _CLOSE and i - 1 in closing:
                if _NUMERIC_GROUP_RE.fullmatch(text[closing[i - 1] + 1:i - 1]):
                    factorial = max(factorial, self.log10(closing[i - 1] + 1, i - 1))
            else:
                factorial = max(factorial, _log10(text[_digits_before(text, i):i]))
        return Structure(depth=depth, tower=1 + max(self.levels.values()) if self.levels else 0,
                         exponent=max(list(self.exponent.values()) + bounds, default=0.0), factorial=factorial,
                         factorial_run=max((len(m.group(0)) for m in re.finditer(r"!+", text)), default=0))


def _digits_before(text: str, i: int) -> int:
    """Where the run of digits (and spaces) that ends at `i` starts."""
    while i > 0 and (text[i - 1].isdigit() or text[i - 1] == " "):
        i -= 1
    return i


def _log10(digits: str) -> float:
    """log10 of the integer these digits write (0 for none, 0 or 1), without building it."""
    digits = digits.replace(" ", "").lstrip("0")
    if not digits.isdigit() or digits == "1":
        return 0.0
    return len(digits) - 15 + math.log10(int(digits[:15])) if len(digits) > 15 else math.log10(int(digits))


_LIMITS = Structure(depth=MAX_DEPTH, tower=MAX_TOWER, exponent=MAX_EXPONENT_LOG10, factorial=MAX_FACTORIAL_LOG10,
                    factorial_run=1)
_WHAT = {"depth": "brackets nested {:.0f} deep", "tower": "a power tower of {:.0f} levels",
         "exponent": "an exponent or bound near 10^{:.0f}", "factorial": "a factorial of a number near 10^{:.0f}",
         "factorial_run": "{:.0f} factorials in a row"}


def excessive(pred: str, gold: str) -> str | None:
    """Why the normalized answer `pred` is too costly to check against `gold` (None: it is not). Graded 0.0."""
    have, need = Structure.of(pred), Structure.of(gold)
    for f in fields(Structure):
        value = getattr(have, f.name)
        if value > max(getattr(_LIMITS, f.name), getattr(need, f.name)):
            return _WHAT[f.name].format(min(value, 1e300))
    return None
