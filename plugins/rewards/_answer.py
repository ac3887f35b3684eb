"""Answer text shared by the reward functions: completion text, final-answer extraction,
and the gold ``answer`` column.

All functions here are plain string work, linear in the input length, so they are safe on
untrusted completions of any size (a 1 MB completion takes milliseconds).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "MAX_ANSWER_CHARS", "completion_text", "extract_answer", "final_boxes", "gold_answers",
    "is_missing", "last_boxed", "strip_special_tokens",
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
MAX_JOINED_BOXES = 10
BARE_ANSWER_CHARS = 100  # a whole completion this short, on one line and not prose, is its answer
TAIL_CHARS = 300  # a bare last number is looked for in this many final characters
# between boxes read as one answer: commas, "and"/"or", spacing, math delimiters, "x ="
_BOX_SEPARATOR_RE = re.compile(
    r"(?:[\s,;$]|\\[()\[\]]|and|or|&|\\q?quad|\\text\{\s*(?:and|or|,)?\s*\}){0,12}"
    r"(?:[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=\s*)?"
)
_CURRENCY_RE = re.compile(r"(?<![\\$\w])\$(?=\d[\d,]*(?:\.\d+)?(?:\s+[A-Za-z]|[.,;:!?)](?!\d)|\s*$))")
_IS_RE = re.compile(r"\s(?:is|are|equals|=)\s")
_PROSE_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}[ \t]+[A-Za-z]{2,}")  # two words in a row
_NUMBER_RE = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?%?(?![\w])")


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


def _box_at(text: str, start: int) -> tuple[str, int] | None:
    """The box starting at ``text[start]`` (``\\boxed`` or ``\\fbox``): (content, end index), or
    None when it is unclosed, too long or too deeply nested."""
    after = start + (6 if text.startswith("\\boxed", start) else 5)
    i = _SPACES_RE.match(text, after).end()
    if i < len(text) and text[i] == "{":
        close = _matching_brace(text, i)
        return None if close is None else (text[i + 1 : close], close + 1)
    if i > after:
        bare = _BARE_BOX_RE.match(text, i)
        if bare:
            return bare.group(0).rstrip("."), bare.end()
    return None


def _last_box_start(text: str, before: int) -> int:
    return max(text.rfind("\\boxed", 0, before), text.rfind("\\fbox", 0, before))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (or ``\\boxed 5``).

    Returns:
        The content, or None when there is no box, or the last one is unclosed (truncated),
        too long or too deeply nested.
    """
    start = _last_box_start(text, len(text))
    if start < 0:
        return None
    box = _box_at(text, start)
    return None if box is None else box[0]


def final_boxes(text: str) -> str | None:
    """The final answer given in boxes: the last box's content, or, when the last boxes stand
    side by side (``\\boxed{1}, \\boxed{2}``, ``\\boxed{1} and \\boxed{2}``), their contents joined
    by ", " as one answer (a set or tuple). None when the last box is unclosed. At most
    ``MAX_JOINED_BOXES`` boxes are read, so the work stays linear in the text length."""
    start = _last_box_start(text, len(text))
    if start < 0:
        return None
    box = _box_at(text, start)
    if box is None:
        return None
    contents = [box[0]]
    while len(contents) < MAX_JOINED_BOXES:
        previous = _last_box_start(text, start)
        if previous < 0:
            break
        box = _box_at(text, previous)
        if box is None or box[1] > start or not _BOX_SEPARATOR_RE.fullmatch(text, box[1], start):
            break
        contents.append(box[0])
        start = previous
    return ", ".join(reversed(contents))


def _strip_currency(text: str) -> str:
    """Removes the dollar signs of amounts (``$1,000.99.``, ``$5 each``), so they are not read
    as math delimiters; ``$12$`` and ``$5 + 3$`` keep theirs."""
    return _CURRENCY_RE.sub("", text) if "$" in text else text


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
    sentence = _SENTENCE_END_RE.split(_strip_currency(rest), maxsplit=1)[0].strip()
    if "$" in sentence or "\\(" in sentence or "\\[" in sentence:
        math = _last_math(sentence)
        after = sentence[sentence.rfind("$") + 1:] if "$" in sentence else sentence[sentence.rfind("\\") + 2:]
        if math and not after.strip(" .,;:!)"):
            return math  # "The final answer is $12$."
    if _IS_RE.search(sentence):  # "The largest $n$ is 34": what follows the last "is"
        sentence = _IS_RE.split(sentence)[-1].strip()
        if "$" in sentence:
            sentence = _last_math(sentence) or sentence.replace("$", "")
    return sentence or None


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


def _last_number(text: str) -> str | None:
    """The last number of the text's last ``TAIL_CHARS`` characters (``12``, ``-3.5``,
    ``1,000``, ``3/4``, ``28%``), for a completion that states its answer in words only."""
    last = None
    for last in _NUMBER_RE.finditer(text, max(0, len(text) - TAIL_CHARS)):
        pass
    return None if last is None else last.group(0)


def extract_answer(text: str) -> str | None:
    """The final answer a completion commits to, or None.

    Chat/special tokens are removed first. Then, in this order:

    1. boxes: the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched;
       ``\\boxed 5``), or of the last boxes standing side by side, joined as one answer
       (``\\boxed{1}, \\boxed{2}`` -> ``1, 2``); nothing else if the last box is unclosed
       (a truncated completion has no answer);
    2. with no box at all, what follows the last "answer is" / "answer:" / "Final Answer:" on
       its line (its ``$...$`` if it has one, else up to the end of the sentence);
    3. the last ``$...$``, ``\\(...\\)`` or ``\\[...\\]``, amounts such as ``$1,000`` not read
       as delimiters;
    4. a completion that is only an answer (one short line, not prose: ``\\frac{1}{2}``,
       ``(1, 2)``, ``28 percent``): all of it;
    5. the last number of the completion's end (``... so 12 apples in all.`` -> ``12``).
    """
    text = strip_special_tokens(text)
    if "\\boxed" in text or "\\fbox" in text:
        return final_boxes(text)
    answer = _answer_phrase(text) or _last_math(_strip_currency(text))
    if answer:
        return answer
    bare = text.strip()
    if bare and len(bare) <= BARE_ANSWER_CHARS and "\n" not in bare and not _PROSE_RE.search(bare):
        return bare
    return _last_number(text)


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
