"""When two numeric answers are equal: exact values, decimals, rounded decimals, numbers in a base.

Rules (gold first, then the answer):

* exact values (integers, fractions, exact expressions) are equal only when equal: 1048575 is not
  2^20, 2010012/2010013 is not 2010012/2010014;
* two decimals, or a decimal and an exact value with a finite decimal form, likewise: 16386.16 is
  not 16386.17, 18 is 18.00, 0.25 is 1/4;
* a decimal and an exact value with no finite decimal form (1/3, sqrt(2), pi) are equal within a
  relative ``REL_TOL`` (0.333333 for 1/3), or when the decimal is that value rounded to the
  decimal's own last digit and gives at least ``MIN_ROUNDED_DIGITS`` significant digits (0.3333,
  2.6667 for 8/3, 1.4142 for sqrt(2); not 0.33 nor 3.14);
* a number in a base (``204_5``, ``4210_{7}``) equals the same digits in the same base, or the
  same digits written without a base on one side; never the same digits in another base.

Plain arithmetic on :class:`fractions.Fraction` of strings at most 200 characters long (no
exponents, so no huge powers).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "MIN_ROUNDED_DIGITS", "REL_TOL", "as_number", "base_number_verdict", "finite_decimal", "numbers_close",
    "rounded_to_own_digits",
]

REL_TOL = Fraction(1, 10**6)
MIN_ROUNDED_DIGITS = 4  # a rounded decimal answer must give at least this many significant digits

_DECIMAL_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION_RE = re.compile(r"(-?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}")
_PLAIN_DECIMAL_RE = re.compile(r"[-+]?(\d*)\.(\d{1,30})")
# digits (0-9, A-Z for bases over 10) and a base subscript: 204_5, 4210_{7}, 0.0011_{2}, A3_{16}
_BASE_NUMBER_RE = re.compile(r"(-?(?=[0-9A-Z.]*\d)[0-9A-Z]+(?:\.[0-9A-Z]+)?)_\{?(\d{1,2})\}?")


def as_number(s: str) -> tuple[Fraction, bool] | None:
    """(exact value, written as a decimal) of a plain decimal, integer or integer fraction."""
    if len(s) > 200:
        return None
    if _DECIMAL_RE.fullmatch(s):
        return Fraction(s), "." in s
    m = _FRACTION_RE.fullmatch(s)
    if m and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return (-value if m.group(1) else value), False
    return None


def finite_decimal(value: Fraction) -> bool:
    """Whether ``value`` has a finite decimal form (its denominator divides a power of 10)."""
    denominator = value.denominator
    for p in (2, 5):
        while denominator % p == 0:
            denominator //= p
    return denominator == 1


def numbers_close(a: Fraction, b: Fraction, a_decimal: bool = False, b_decimal: bool = False,
                  irrational: bool = False) -> bool:
    """Whether two numbers are equal, by the module's rules.

    Args:
        a, b: The values (exact, or the 30-digit value of an irrational number).
        a_decimal, b_decimal: Whether each side was written as a decimal.
        irrational: Whether the side not written as a decimal is irrational (its value here is
            an approximation, with no finite decimal form in truth).
    """
    if a == b:
        return True
    if a_decimal == b_decimal:  # two exact values, or two decimals: equal only when equal
        return False
    exact = b if a_decimal else a
    if not irrational and finite_decimal(exact):
        return False
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def rounded_to_own_digits(gold: Fraction, pred: str, irrational: bool = False) -> bool:
    """Whether ``pred``, a plain decimal with at least ``MIN_ROUNDED_DIGITS`` significant digits, is
    ``gold`` rounded to ``pred``'s own last digit, for a gold with no finite decimal form (0.3333
    for 1/3, 2.6667 for 8/3, 1.4142 for sqrt(2)); a gold with a finite decimal form needs the
    number itself (5.001 is not 5, 16386.2 is not 16386.17).

    Args:
        gold: The gold value (exact, or the 30-digit value of an irrational number).
        pred: The answer's text.
        irrational: Whether ``gold`` is irrational (never a finite decimal).
    """
    m = _PLAIN_DECIMAL_RE.fullmatch(pred)
    if not m or len((m.group(1) + m.group(2)).lstrip("0")) < MIN_ROUNDED_DIGITS:
        return False
    if not irrational and finite_decimal(gold):
        return False
    return abs(gold - Fraction(pred)) <= Fraction(1, 2 * 10 ** len(m.group(2)))


def base_number_verdict(gold: str, pred: str) -> bool | None:
    """The verdict on numbers written in a base (``204_5``), or None when neither side is one."""
    g, p = _BASE_NUMBER_RE.fullmatch(gold), _BASE_NUMBER_RE.fullmatch(pred)
    if g is None and p is None:
        return None
    g_digits, g_base = (g.group(1), g.group(2)) if g else (gold, None)
    p_digits, p_base = (p.group(1), p.group(2)) if p else (pred, None)
    if g_base is not None and p_base is not None and int(g_base) != int(p_base):
        return False
    return g_digits == p_digits
