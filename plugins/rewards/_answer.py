"""Answer text shared by the reward functions: completion text, final-answer extraction,
and the gold ``answer`` column.

All functions here are plain string work, linear in the input length, so they are safe on
untrusted completions of any size (a 1 MB completion takes milliseconds).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "MAX_ANSWER_CHARS", "completion_text", "extract_answer", "gold_answers", "is_missing",
    "last_boxed", "strip_special_tokens",
]

MAX_ANSWER_CHARS = 1000  # longer extracted answers are refused (0.0) before any parsing
MAX_BRACE_DEPTH = 50

_SPECIAL_TOKEN_RE = re.compile(
    r"<\|[^<>|\s]{1,64}\|>|<\uff5c[^<>\uff5c]{1,64}\uff5c>"  # <|im_end|>, <｜end▁of▁sentence｜>
    r"|</?s>|<(?:eos|bos|pad|unk|eot|end_of_turn|start_of_turn)>"
)
_SPACES_RE = re.compile(r"\s*")
_BARE_BOX_RE = re.compile(r"[^\s$]{1,%d}" % MAX_ANSWER_CHARS)  # \boxed 5
_ANSWER_PHRASE_RE = re.compile(r"answer(?:\*\*)?[ \t]*(?:is\b|:)[ \t]*:?", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")


def completion_text(completion: Any) -> str:
    """Text of a completion: a string, or the content of the last assistant message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _message_content(completion)
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        chosen = [m for m in messages if m.get("role") == "assistant"] or messages
        return _message_content(chosen[-1]) if chosen else ""
    return "" if completion is None else str(completion)


def _message_content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def strip_special_tokens(text: str) -> str:
    """Removes chat/special tokens such as ``<|im_end|>``, ``</s>``, ``<eos>``."""
    return _SPECIAL_TOKEN_RE.sub("", text)


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the brace closing ``text[open_index]`` (a ``{``), or None when it is not
    closed within ``MAX_ANSWER_CHARS`` characters or nests deeper than ``MAX_BRACE_DEPTH``."""
    depth, i = 0, open_index
    end = min(len(text), open_index + MAX_ANSWER_CHARS + 2)
    while i < end:
        char = text[i]
        if char == "\\":  # escaped character, e.g. \{ or \}
            i += 2
            continue
        if char == "{":
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                return None
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (or ``\\boxed 5``).

    Returns:
        The content, or None when there is no box, or the last one is unclosed (truncated),
        too long or too deeply nested.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after = start + (6 if text.startswith("\\boxed", start) else 5)
    i = _SPACES_RE.match(text, after).end()
    if i < len(text) and text[i] == "{":
        close = _matching_brace(text, i)
        return None if close is None else text[i + 1 : close]
    if i > after:
        bare = _BARE_BOX_RE.match(text, i)
        if bare:
            return bare.group(0).rstrip(".")
    return None


def _answer_phrase(text: str) -> str | None:
    """What follows the last "answer is" / "answer:" on its line."""
    last = None
    for last in _ANSWER_PHRASE_RE.finditer(text):
        pass
    if last is None:
        return None
    line_end = text.find("\n", last.end())
    stop = len(text) if line_end < 0 else line_end
    rest = text[last.end() : min(stop, last.end() + MAX_ANSWER_CHARS + 1)].strip(" \t*")
    if "$" in rest or "\\(" in rest:
        return _last_math(rest) or None
    return _SENTENCE_END_RE.split(rest, maxsplit=1)[0].strip() or None


def _last_math(text: str) -> str | None:
    """Content of the last ``$...$``, ``$$...$$``, ``\\(...\\)`` or ``\\[...\\]``."""
    text = text.replace("$$", "$")
    best: tuple[int, str] | None = None
    for opener, closer in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        close = text.rfind(closer)
        open_ = text.rfind(opener, 0, close) if close > 0 else -1
        if open_ >= 0 and (best is None or close > best[0]):
            best = (close, text[open_ + len(opener) : close])
    return best[1].strip() if best else None


def extract_answer(text: str) -> str | None:
    """The final answer a completion commits to, or None.

    Chat/special tokens are removed first. Then: the content of the last ``\\boxed{...}`` /
    ``\\fbox{...}`` (brace-matched; ``\\boxed 5``), and nothing else if that box is unclosed;
    with no box at all, what follows the last "answer is" / "answer:" on its line (up to
    the end of the sentence, or its ``$...$``); failing that, the last ``$...$``,
    ``\\(...\\)`` or ``\\[...\\]``.
    """
    text = strip_special_tokens(text)
    if "\\boxed" in text or "\\fbox" in text:
        return last_boxed(text)
    return _answer_phrase(text) or _last_math(text)


def gold_answers(kwargs: dict, n: int, reward_name: str) -> list:
    """The ``answer`` column from the reward kwargs, checked against ``n`` completions."""
    if "answer" not in kwargs:
        raise ValueError(
            f"The {reward_name} reward needs an `answer` column in the dataset (the gold "
            f"answer of each prompt); the columns passed were: {sorted(kwargs)}."
        )
    answers = kwargs["answer"]
    if isinstance(answers, (str, int, float)) or answers is None:
        answers = [answers] * n
    answers = list(answers)
    if len(answers) != n:
        raise ValueError(f"{reward_name}: {len(answers)} answers for {n} completions.")
    return answers


def is_missing(gold: Any) -> bool:
    """True for a gold answer that cannot be graded: None, NaN or blank."""
    return gold is None or gold != gold or (isinstance(gold, str) and not gold.strip())
