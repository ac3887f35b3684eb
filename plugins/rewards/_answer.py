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
BARE_ENVIRONMENT_CHARS = 400  # ... or one LaTeX environment (a matrix) this short, over several lines
TAIL_CHARS = 300  # a bare last number is looked for in this many final characters
# between boxes read as one answer: commas, "and"/"or", spacing, math delimiters, "x ="; or a few
# words ending in "and"/"or" ("\boxed{(3, 3)} \text{ for part (a) and } \boxed{(1, 1)}",
# "\boxed{1} papers and \boxed{2}"), but not other words ("\boxed{1} no no \boxed{2}")
_BOX_SEPARATOR_RE = re.compile(
    r"(?:[\s,;$]|\\[()\[\]]|and|or|&|\\q?quad|\\text\{\s*(?:and|or|,)?\s*\})*"
    r"(?:[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=\s*)?"
)
_NO_LETTERS_RE = re.compile(r"[^A-Za-z\\]*")
_WORDS_THEN_AND_RE = re.compile(
    r"[\s$]*(?:\\text\s*\{)?[A-Za-z (),.]{0,40}?\b(?:and|or)\s*\}?[\s$]*(?:[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=\s*)?"
)
# an amount's "$" (not "$16,\\!386$", whose comma is a LaTeX thousands separator)
_CURRENCY_RE = re.compile(r"(?<![\\$\w])\$(?=\d[\d,]*(?:\.\d+)?(?:\s+[A-Za-z]|[.,;:!?)](?![\d\\{])|\s*$))")
_QUOTES_RE = re.compile(r'^\\?["\u201c]|\\?["\u201d]$')
_MATH_LIST_SEPARATOR_RE = re.compile(r"(?:\s|,|\band\b|\bor\b)*")
_IS_RE = re.compile(r"\s(?:is|are|equals|=)\s")
_PROSE_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}[ \t]+[A-Za-z]{2,}")  # two words in a row
_LEAD_WORD_RE = re.compile(r"^[^\d\\]*?(?<![\\A-Za-z])[A-Za-z]{3,}[^\d]*\d")  # a word before the first digit
_ENVIRONMENT_RE = re.compile(r"\\begin\{([a-zA-Z*]{1,20})\}.*\\end\{\1\}", re.DOTALL)
_MATHY_RE = re.compile(r"\d|\\[A-Za-z]")
# a number standing alone in prose: 12, -3.5, 1,000.99, 3/4, 28%, 1,000.99m², 2,74 (a decimal comma)
_NUMBER_RE = re.compile(
    r"(?<![\w.,/^_({\[\\])"
    r"(?:(?P<comma>[-+]?\d+,\d{1,2})(?![\d,])|(?P<num>[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?))"
    r"(?:%|[A-Za-z]{1,3}[²³]?(?=[\s.,;:!?)]|$))?(?![\w^])"
)


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


def _separates_boxes(text: str, start: int, end: int, gold: bool) -> bool:
    """Whether ``text[start:end]``, between two boxes, makes them one answer; in a gold answer
    also any text without letters (``\\boxed{35} ++++ \\boxed{4}``)."""
    if end - start > 60:
        return False
    if gold and _NO_LETTERS_RE.fullmatch(text, start, end):
        return True
    return bool(_BOX_SEPARATOR_RE.fullmatch(text, start, end) or _WORDS_THEN_AND_RE.fullmatch(text, start, end))


def _final_boxes(text: str, gold: bool = False) -> tuple[str, int] | None:
    """(final boxed answer, end index of its last box); see :func:`final_boxes`."""
    start = _last_box_start(text, len(text))
    if start < 0:
        return None
    box = _box_at(text, start)
    if box is None:
        return None
    contents, end = [box[0]], box[1]
    while len(contents) < MAX_JOINED_BOXES:
        previous = _last_box_start(text, start)
        if previous < 0:
            break
        box = _box_at(text, previous)
        if box is None or box[1] > start or not _separates_boxes(text, box[1], start, gold):
            break
        contents.append(box[0])
        start = previous
    return ", ".join(reversed(contents)), end


def final_boxes(text: str, gold: bool = False) -> str | None:
    """The final answer given in boxes: the last box's content, or, when the last boxes stand
    side by side (``\\boxed{1}, \\boxed{2}``, ``\\boxed{1} and \\boxed{2}``), their contents joined
    by ", " as one answer (a set or tuple). None when the last box is unclosed. At most
    ``MAX_JOINED_BOXES`` boxes are read, so the work stays linear in the text length.

    Args:
        text: A completion, or (``gold=True``) a gold answer, whose boxes are also one answer
            when only signs stand between them."""
    found = _final_boxes(text, gold)
    return None if found is None else found[0]


def _strip_currency(text: str) -> str:
    """Removes the dollar signs of amounts (``$1,000.99.``, ``$5 each``), so they are not read
    as math delimiters; ``$12$`` and ``$5 + 3$`` keep theirs."""
    return _CURRENCY_RE.sub("", text) if "$" in text else text


def _answer_phrase(text: str) -> tuple[str, int] | None:
    """What follows the last "answer is" / "answer:" on its line, and where the phrase starts."""
    last = None
    for last in _ANSWER_PHRASE_RE.finditer(text):
        pass
    if last is None:
        return None
    line_end = text.find("\n", last.end())
    stop = len(text) if line_end < 0 else line_end
    rest = text[last.end() : min(stop, last.end() + MAX_ANSWER_CHARS + 1)].strip(" \t*")
    sentence = _SENTENCE_END_RE.split(_strip_currency(rest), maxsplit=1)[0].strip()
    sentence = _QUOTES_RE.sub("", sentence).strip()  # 'The final answer is "$12$ and $13$".'
    spans = re.findall(r"\$([^$]+)\$", sentence)
    if len(spans) > 1 and _MATH_LIST_SEPARATOR_RE.fullmatch(re.sub(r"\$[^$]+\$", "", sentence)):
        return ", ".join(span.strip() for span in spans), last.start()  # "$12$ and $13$": one list
    if "$" in sentence or "\\(" in sentence or "\\[" in sentence:
        math = _last_math(sentence)
        after = sentence[sentence.rfind("$") + 1:] if "$" in sentence else sentence[sentence.rfind("\\") + 2:]
        if math and not after.strip(" .,;:!)"):
            return math, last.start()  # "The final answer is $12$."
    if _IS_RE.search(sentence):  # "The largest $n$ is 34": what follows the last "is"
        sentence = _IS_RE.split(sentence)[-1].strip()
        if "$" in sentence:
            sentence = _last_math(sentence) or sentence.replace("$", "")
    if _PROSE_RE.search(sentence) and "$" not in sentence:
        numbers = list(_NUMBER_RE.finditer(sentence))
        if len(numbers) == 1:  # "Jane started growing Sphere 3 hours ago": its one number
            sentence = _number_value(numbers[0])
    return (sentence, last.start()) if sentence else None


def _last_math_span(text: str) -> tuple[str, int] | None:
    """(content, index of the closing delimiter) of the last ``$...$``, ``\\(...\\)`` or
    ``\\[...\\]`` (``$$`` already read as ``$``)."""
    best: tuple[int, str] | None = None
    for opener, closer in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        close = text.rfind(closer)
        open_ = text.rfind(opener, 0, close) if close > 0 else -1
        if open_ >= 0 and (best is None or close > best[0]):
            best = (close, text[open_ + len(opener) : close])
    return (best[1].strip(), best[0]) if best else None


def _last_math(text: str) -> str | None:
    """Content of the last ``$...$``, ``$$...$$``, ``\\(...\\)`` or ``\\[...\\]``."""
    span = _last_math_span(text.replace("$$", "$"))
    return span[0] if span else None


def _last_number(text: str) -> tuple[str, int] | None:
    """(the last number of the text's last ``TAIL_CHARS`` characters, its end index), for a
    completion that states its answer in words only: ``12``, ``-3.5``, ``1,000``, ``3/4``,
    ``28%``, ``1,000.99m²`` (a unit after it), ``2,74 €`` (a decimal comma, read as 2.74)."""
    last = None
    for last in _NUMBER_RE.finditer(text, max(0, len(text) - TAIL_CHARS)):
        pass
    return None if last is None else (_number_value(last), last.end())


def _number_value(match: re.Match) -> str:
    """The number of a ``_NUMBER_RE`` match, a decimal comma read as a point."""
    return match.group("comma").replace(",", ".") if match.group("comma") else match.group("num")


def _bare_answer(text: str) -> str | None:
    """The whole completion when it is only an answer: one short line that is not prose
    (``\\frac{1}{2}``, ``(1, 2)``, ``28 percent``, ``Evelyn``), or one short LaTeX environment
    (a matrix over several lines)."""
    bare = text.strip()
    if not bare:
        return None
    if "\n" in bare:
        single = len(bare) <= BARE_ENVIRONMENT_CHARS and _ENVIRONMENT_RE.fullmatch(bare)
        return bare if single and bare.count("\\begin") == 1 else None
    if len(bare) > BARE_ANSWER_CHARS or _PROSE_RE.search(bare) or _LEAD_WORD_RE.match(bare):
        return None  # prose, or words leading up to a number ("Soucis : 2,74 $")
    return bare


def _last_expression(text: str) -> str | None:
    """The last standalone expression: the last ``$...$`` (or ``\\(...\\)``, ``\\[...\\]``) or the
    last number of the text's end, whichever comes later."""
    text = _strip_currency(text).replace("$$", "$")
    math, number = _last_math_span(text), _last_number(text)
    if math and number:
        return number[0] if number[1] > math[1] else math[0]
    return math[0] if math else number[0] if number else None


def extract_answer(text: str, gold: bool = False) -> str | None:
    """The final answer a completion commits to, or None.

    Chat/special tokens are removed first. Then, in this order:

    1. boxes: the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched;
       ``\\boxed 5``), or of the last boxes standing side by side, joined as one answer
       (``\\boxed{1}, \\boxed{2}`` -> ``1, 2``); nothing else if the last box is unclosed
       (a truncated completion has no answer). An answer statement (2.) made after the last box
       overrides it ("... \\boxed{255} ... Final Answer: The final answer is $10,455$");
    2. with no box, what follows the last "answer is" / "answer:" / "Final Answer:" on its
       line: its ``$...$`` if it ends with one, else up to the end of the sentence (after its last
       "is"; a sentence in words with one number: that number);
    3. a completion that is only an answer (one short line, not prose: ``\\frac{1}{2}``,
       ``(1, 2)``, ``28 percent``; or one short LaTeX environment): all of it;
    4. the last standalone expression: the last ``$...$``, ``\\(...\\)`` or ``\\[...\\]`` (amounts
       such as ``$1,000`` are not delimiters) or the last number of the completion's end
       (``... so 12 apples in all.`` -> ``12``), whichever comes later.

    ``gold=True`` reads a worked solution given as the gold answer: its boxes are one answer
    also when only signs stand between them (:func:`final_boxes`).
    """
    text = strip_special_tokens(text)
    phrase = _answer_phrase(text)
    if "\\boxed" in text or "\\fbox" in text:
        boxes = _final_boxes(text, gold)
        if boxes is None:
            return None
        if phrase and phrase[1] >= boxes[1] and _MATHY_RE.search(phrase[0]):
            return phrase[0]
        return boxes[0]
    if phrase:
        return phrase[0]
    return _bare_answer(text) or _last_expression(text)


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
