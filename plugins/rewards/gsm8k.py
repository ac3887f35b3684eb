"""Reward ``gsm8k``: 1.0 if a completion's final number equals the GSM8K gold answer, else 0.0.

Gold: the dataset's ``answer`` column, either a GSM8K worked solution ending in
``#### 1,234`` (the number after the last ``####`` counts) or a plain number string.

Prediction, in order of preference:

1. the content of the last ``\\boxed{...}`` (``\\boxed{\\$1,234}``, ``\\boxed{18 \\text{ eggs}}``,
   ``\\boxed{x = 18}`` all give 18); an unclosed last box (truncated output) gives nothing;
2. else the number right after the last ``####``;
3. else the last number anywhere in the completion.

Numbers compare as exact rationals after dropping thousands commas, ``$`` and ``%``
(``18 == 18.0 == 18.00``), with a relative tolerance of 1e-6. No sympy is involved; all
regexes are linear-time, so a 1 MB completion is scored in milliseconds.
"""

from __future__ import annotations

import re
import warnings
from fractions import Fraction
from typing import Any

from ._answer import completion_text, gold_answers, is_missing, last_boxed, strip_special_tokens
from .math_sympy import normalize_answer, numbers_close

__all__ = ["gsm8k", "parse_number", "predicted_number"]

_MAX_NUMBER_CHARS = 100  # longer digit strings are not answers (and int() refuses > 4300)
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_EXACT_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION_RE = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_WARNED = [False]


def parse_number(text: str) -> Fraction | None:
    """Exact value of a number string such as ``1,234``, ``$18.00``, ``-3``, ``50%``.

    Returns:
        The value, or None when ``text`` is not a single plain number.
    """
    s = text.strip().replace(",", "").replace("$", "").replace("%", "").strip()
    s = s.rstrip(".")
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    if _EXACT_NUMBER_RE.fullmatch(s):
        return Fraction(s)
    frac = _FRACTION_RE.fullmatch(s)
    if frac and int(frac.group(3)) != 0:
        value = Fraction(int(frac.group(2)), int(frac.group(3)))
        return -value if frac.group(1) else value
    return None


def _number_token(match: re.Match | None) -> Fraction | None:
    if match is None or len(match.group(0)) > _MAX_NUMBER_CHARS:
        return None
    return Fraction(match.group(0).replace(",", ""))


def _boxed_number(box: str) -> Fraction | None:
    """Number in a box: the whole normalised box, else the first number after any ``=``."""
    if len(box) > 1000:
        return None
    whole = parse_number(normalize_answer(box))
    if whole is not None:
        return whole
    tail = box.rsplit("=", 1)[-1].replace("{,}", ",").replace("\\!", "")
    return _number_token(_NUMBER_RE.search(tail))


def predicted_number(text: str) -> Fraction | None:
    """The number a completion ends on (see the module docstring), or None."""
    text = strip_special_tokens(text)
    if "\\boxed" in text or "\\fbox" in text:
        box = last_boxed(text)
        return None if box is None else _boxed_number(box)
    hashes = text.rfind("####")
    if hashes >= 0:
        return _number_token(_NUMBER_RE.search(text, hashes + 4, hashes + 4 + 200))
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return _number_token(last)


def _gold_number(gold: Any) -> Fraction | None:
    text = str(gold)
    hashes = text.rfind("####")
    if hashes >= 0:
        text = text[hashes + 4 :]
    value = parse_number(text)
    if value is None:
        value = parse_number(normalize_answer(text.strip()))
    return value


def gsm8k(
    prompts: list | None, completions: list, completion_ids: list | None = None, **kwargs: Any
) -> list[float | None]:
    """Scores each completion 1.0 if its final number equals the gold ``answer``, else 0.0.

    Args:
        prompts: The prompts (unused).
        completions: Strings, or chat message lists (the last assistant message is graded).
        completion_ids: Token ids (unused).
        **kwargs: Dataset columns; ``answer`` is required, others are ignored.

    Returns:
        One score per completion; None where the gold answer is None, blank, or has no
        number to compare with (the first such gold answer is named in a warning).

    Raises:
        ValueError: The dataset has no ``answer`` column.
    """
    answers = gold_answers(kwargs, len(completions), "gsm8k")
    scores: list[float | None] = []
    for completion, gold in zip(completions, answers):
        gold_value = None if is_missing(gold) else _gold_number(gold)
        if gold_value is None:
            if not is_missing(gold) and not _WARNED[0]:
                _WARNED[0] = True
                warnings.warn(f"gsm8k: gold answer without a number, not scored: {str(gold)[:80]!r}")
            scores.append(None)
            continue
        pred = predicted_number(completion_text(completion))
        scores.append(1.0 if pred is not None and numbers_close(gold_value, pred) else 0.0)
    return scores
