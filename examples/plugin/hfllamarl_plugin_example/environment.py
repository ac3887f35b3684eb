"""An example environment plugin: ``guess_number``, a game with state, tools and its own reward.

Registered in ``pyproject.toml`` under the entry-point group ``hfllamarl.environments``, so after
``pip install ./examples/plugin``::

    AsyncAIPOTrainer(..., environment_factory="guess_number")

One instance per rollout (created on the generator, reused across batches with ``reset``): the model
calls ``guess(number)`` and reads "higher", "lower" or "correct"; ``get_reward`` pays 1.0 for finding
the number, 0.1 less for every extra guess. Standard library only.
"""

from __future__ import annotations

import zlib

__all__ = ["GuessNumber"]


class GuessNumber:
    """Find a secret number between 1 and 100 (the row's ``secret`` column, else one derived from the prompt)."""

    def __init__(self):
        self.secret, self.guesses, self.solved = 1, 0, False

    def reset(self, **row) -> str:
        """Called before each rollout with the dataset row; the returned text is appended to the prompt."""
        if row.get("secret") is not None:
            self.secret = int(row["secret"])
        else:
            self.secret = 1 + zlib.crc32(repr(row.get("prompt")).encode()) % 100
        self.guesses, self.solved = 0, False
        return " Find the number between 1 and 100 with the guess tool."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: A whole number between 1 and 100.
        """
        if self.solved:
            return "already found"
        self.guesses += 1
        number = int(number)
        if number == self.secret:
            self.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        """1.0 for finding the number in one guess, 0.1 less per extra guess (at least 0.1); 0.0 if not found."""
        return max(0.1, 1.0 - 0.1 * (self.guesses - 1)) if self.solved else 0.0
