"""An example hfllamarl reward plugin: ``last_digit``.

Registered in ``pyproject.toml`` under the entry-point group ``hfllamarl.rewards``, so after
``pip install ./examples/plugin`` the trainer loads it by name::

    AsyncAIPOTrainer(..., reward_funcs="last_digit")

Standard library only: importing it must not pull anything heavy into the trainer processes.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["last_digit"]
__version__ = "0.1.0"

_DIGIT = re.compile(r"\d")


def _text(completion: Any) -> str:
    """The completion's text: a string, or the content of the last message of a chat completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                return str(message.get("content") or "")
        return ""
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return str(completion)


def last_digit(
    prompts: list | None, completions: list, completion_ids: list | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the last digit in the completion equals the ``answer`` column, else 0.0.

    Args:
        prompts: The prompts (unused).
        completions: Strings, or chat message lists ``[{"role": "assistant", "content": ...}]``.
        completion_ids: Token ids (unused).
        **kwargs: Dataset columns; ``answer`` holds the gold answer per sample, a single digit
            such as ``"7"`` (compared as a string, surrounding whitespace ignored). Other columns
            and trainer extras (``trainer_state``) are ignored.

    Returns:
        One score per completion: 1.0 or 0.0, or None where the gold answer is None ("not scored
        by this function"). A completion without any digit scores 0.0.
    """
    answers = kwargs.get("answer")
    if answers is None:
        raise ValueError("last_digit needs an 'answer' column in the dataset.")
    scores: list[float | None] = []
    for completion, gold in zip(completions, answers):
        if gold is None:
            scores.append(None)
            continue
        digits = _DIGIT.findall(_text(completion))
        scores.append(1.0 if digits and digits[-1] == str(gold).strip() else 0.0)
    return scores
