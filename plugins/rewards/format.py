"""Format rewards: ``boxed_format`` (did the completion box an answer?) and ``length``
(a soft penalty for completions that run too long).

``boxed_format``: 1.0 if the completion's last ``\\boxed{...}`` / ``\\fbox{...}`` is closed
and not empty (the box ``math_sympy`` grades), else 0.0. A completion truncated inside its
last box scores 0.0 even if an earlier box was complete, as ``math_sympy`` would not read it.

``length``: the overlong penalty of DAPO (Yu et al., 2025), with ``L`` the completion length,
``L_max = max_length`` and ``C = soft_cache``::

    r(L) = 0                          if L <= L_max - C
    r(L) = (L_max - C - L) / C        if L_max - C < L <= L_max   (falls linearly 0 -> -1)
    r(L) = -1                         if L > L_max

``L`` counts tokens (``len(completion_ids[i])``) when the trainer passes ``completion_ids``,
else characters / 4 (a rough tokens-per-character estimate). The built-in ``length`` uses
``max_length=1024``, ``soft_cache=256``; :func:`length_penalty` makes one with other limits.
"""

from __future__ import annotations

from typing import Any, Callable

from ._answer import completion_text, last_boxed, strip_special_tokens

__all__ = ["boxed_format", "length", "length_penalty"]

CHARS_PER_TOKEN = 4


def boxed_format(
    prompts: list | None, completions: list, completion_ids: list | None = None, **kwargs: Any
) -> list[float]:
    """1.0 per completion whose last ``\\boxed{...}`` is closed and non-empty, else 0.0.

    Args:
        prompts: The prompts (unused).
        completions: Strings, or chat message lists (the last assistant message is read).
        completion_ids: Token ids (unused).
        **kwargs: Dataset columns and trainer extras (ignored).

    Returns:
        One score per completion.
    """
    scores = []
    for completion in completions:
        box = last_boxed(strip_special_tokens(completion_text(completion)))
        scores.append(1.0 if box is not None and box.strip() else 0.0)
    return scores


def length_penalty(max_length: int = 1024, soft_cache: int = 256) -> Callable[..., list[float]]:
    """Makes a ``length`` reward with the given limits (formula in the module docstring).

    Args:
        max_length: ``L_max``: completions longer than this get -1.0. Set it to the
            trainer's ``max_completion_length`` to punish truncated completions fully.
        soft_cache: ``C``: the penalty ramps from 0 to -1 over the last ``C`` units.

    Returns:
        A reward function with TRL's signature, named ``length``.

    Raises:
        ValueError: ``soft_cache`` is not in ``(0, max_length]``.
    """
    if not 0 < soft_cache <= max_length:
        raise ValueError(
            f"length_penalty needs 0 < soft_cache <= max_length, got soft_cache={soft_cache} "
            f"and max_length={max_length}."
        )
    threshold = max_length - soft_cache

    def length(
        prompts: list | None, completions: list, completion_ids: list | None = None, **kwargs: Any
    ) -> list[float]:
        """Soft overlong penalty per completion: 0.0 (short enough) down to -1.0."""
        scores = []
        for i, completion in enumerate(completions):
            if completion_ids is not None:
                size = len(completion_ids[i])
            else:
                size = len(completion_text(completion)) / CHARS_PER_TOKEN
            if size <= threshold:
                scores.append(0.0)
            elif size <= max_length:
                scores.append((threshold - size) / soft_cache)
            else:
                scores.append(-1.0)
        return scores

    length.max_length = max_length  # type: ignore[attr-defined]
    length.soft_cache = soft_cache  # type: ignore[attr-defined]
    return length


length = length_penalty()
