"""Canonical string form of a math answer (:func:`normalize_answer`), shared by the graders.

Plain string work: regular expressions without nested quantifiers, linear in the input, safe on
untrusted text (answers reaching here are at most ``MAX_ANSWER_CHARS`` long anyway).
"""

from __future__ import annotations

import re

__all__ = ["CHOICE_RE", "WORDS_RE", "normalize_answer", "unescape_commands"]

_SPACING_RE = re.compile(r"\\\\|\\[!,;: ]|\\q?quad(?![A-Za-z])|~")
_THOUSANDS_SPACE_RE = re.compile(r"(?<=\d),\s*\\!\s*(?=\d)")
# "19, 46, and 82", "12 and 13", "(11,7)or(7,11)": a list
_AND_LIST_RE = re.compile(r"\s*,?\s+(?:and|or)\s+|(?<=[\d)\]}])(?:and|or)(?=[(\[{A-Z\\])")
# a doubled backslash before a command name: LaTeX escaped once more ("\\\\frac" in a JSON-ish string)
_ESCAPED_COMMAND_RE = re.compile(
    r"\\\\(?=(?:[dtc]?frac|sqrt|text[a-z]*|boxed|fbox|pi|cdot|times|div|pm|mp|le|ge|leq|geq|neq|lt|gt"
    r"|infty|in|cup|cap|left|right|math[a-z]+|circ|degree|alpha|beta|gamma|theta|sin|cos|tan|log|ln)(?![A-Za-z]))"
)
_EQUATION_ITEM_RE = re.compile(r"([^=,]{1,20})=([^=]+)")
_SIZING_RE = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
_UNIT_TAIL_RE = re.compile(
    r"(?<=[\d})])\s*\\(?:text|textrm|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?)?\s*$"
)
_TEXT_WRAP_RE = re.compile(
    r"\\(?:text|textrm|textbf|textit|textnormal|mbox|mathrm|mathbf|mathit)\s*\{([^{}]*)\}"
)
# whitespace goes, but after a command before a letter ("\\pi r") and after a comma between
# digits ("32, 349" is a pair, "32,349" a thousands number)
_WHITESPACE_RE = re.compile(r"(?P<cmd>\\[A-Za-z]+)\s+(?=[A-Za-z])|(?P<pair>(?<=\d,)\s+(?=\d))|\s+")
_SHORT_FRAC_RE = re.compile(r"\\frac(\d)(\d)|\\frac(\d)\{|\\frac\{([^{}]*)\}(\d)")
_SHORT_SQRT_RE = re.compile(r"\\sqrt(\d)")
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?(?:=|\\in(?![A-Za-z]))")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_COMMA_RE = re.compile(r"-?(?:0,\d+|\d{4,},\d{1,2})")  # "1,2" stays a pair
CHOICE_RE = re.compile(r"\(?([A-H])\)?")
_INT_RATIO_RE = re.compile(r"(-?\d+)/(\d+)")
WORDS_RE = re.compile(r"[A-Za-z]{2,}(?: [A-Za-z]+)*")
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


def _whitespace(m: re.Match) -> str:
    return m.group("cmd") + " " if m.group("cmd") else " " if m.group("pair") else ""


def unescape_commands(text: str) -> str:
    """``\\\\frac{1}{2}`` -> ``\\frac{1}{2}``: a doubled backslash before a known command name
    (text escaped twice); a LaTeX line break ``\\\\`` before anything else stays."""
    return _ESCAPED_COMMAND_RE.sub(r"\\", text) if "\\\\" in text else text


def _split_top_level(s: str) -> list[str]:
    """``s`` split at the commas outside brackets and braces."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(s):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    return items + [s[start:]]


def _same_side_values(s: str) -> str:
    """``x=1,x=-2`` -> ``1,-2``: a list of equations that all give the same left side a value
    is the list of the values (``a=1,b=2`` stays)."""
    items = _split_top_level(s)
    if len(items) < 2:
        return s
    matches = [_EQUATION_ITEM_RE.fullmatch(item.strip()) for item in items]
    if not all(matches) or len({m.group(1).strip() for m in matches}) != 1:
        return s
    return ", ".join(m.group(2).strip() for m in matches)


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer, for cheap equality and for parsing.

    Examples: ``\\dfrac{1}{2}`` -> ``\\frac{1}{2}``; ``1,234`` -> ``1234``; ``90^\\circ`` -> ``90``;
    ``x = 3`` -> ``3``; ``\\text{(C)}`` -> ``C``; ``15\\mbox{ cm}^2`` -> ``15``; ``3/4`` ->
    ``\\frac{3}{4}``; ``\\left( 3, \\frac{\\pi}{2} \\right)`` -> ``(3,\\frac{\\pi}{2})``.
    """
    s = unescape_commands(answer.strip())
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = _THOUSANDS_SPACE_RE.sub(",", s)  # "11,\\! 111": a thousands separator, not a list
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
    if WORDS_RE.fullmatch(s):  # a word answer ("Evelyn", "odd"): case-insensitive
        return s.lower()
    s = _AND_LIST_RE.sub(", ", s)
    spaced_comma = ", " in s  # "32, 349" is a pair, "32,349" a thousands separator
    decimal_comma = _DECIMAL_COMMA_RE.fullmatch(s)  # "1000,99", "0,111": a decimal comma
    if decimal_comma:
        s = s.replace(",", ".")
    s = _WHITESPACE_RE.sub(_whitespace, s)
    s = _same_side_values(s)
    s = _SHORT_FRAC_RE.sub(_fix_short_frac, s)
    s = _SHORT_SQRT_RE.sub(r"\\sqrt{\1}", s)
    assignment = _ASSIGNMENT_RE.match(s)
    if assignment and "=" not in s[assignment.end() :]:  # not "a=1,b=2"
        s = s[assignment.end() :]
    if not spaced_comma and _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = s.lstrip("+")
    choice = CHOICE_RE.fullmatch(s)
    if choice:
        return choice.group(1)
    ratio = _INT_RATIO_RE.fullmatch(s)
    if ratio:
        return "\\frac{%s}{%s}" % ratio.groups()
    return s


