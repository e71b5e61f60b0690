"""An example environment for multi-turn GRPO (``train.grpo.environment:
data/environments/guess_number.py:GuessNumber``): find a secret whole number in a range by guessing, told after
each guess whether the secret is higher or lower. The optimal play (bisection) takes at most
``ceil(log2(high - low + 1))`` guesses, so the task has expert trajectories to learn from first
(``data/guess_number/train_chat.parquet``, made by ``scripts/make_guess_data.py``) and a reward to improve on.

TRL 1.16's ``environment_factory`` contract: one instance per rollout, :meth:`GuessNumber.reset` with the row's
columns, the public methods (:meth:`GuessNumber.guess`) offered as tools, :meth:`GuessNumber.get_reward` read when
the rollout ends. Written by this project.
"""

from __future__ import annotations


class GuessNumber:
    """The guessing game; one instance per rollout."""

    def __init__(self):
        self._low, self._high, self._secret, self._guesses, self._solved = 1, 1, 1, 0, False

    def reset(self, low: int, high: int, secret: int, **row) -> None:
        """Start a game from a row's ``low``, ``high`` and ``secret`` columns (the prompt states the task)."""
        self._low, self._high, self._secret = int(low), int(high), int(secret)
        self._guesses, self._solved = 0, False

    def guess(self, number: int) -> str:
        """Guess the secret number; the answer says whether the secret is higher or lower, or that it is found.

        Args:
            number: The guess, a whole number in the game's range.
        """
        if self._solved:
            return "The secret was already found."
        self._guesses += 1
        number = int(number)
        if number < self._secret:
            return f"{number} is too low: the secret is higher."
        if number > self._secret:
            return f"{number} is too high: the secret is lower."
        self._solved = True
        return f"{number} is correct."

    def get_reward(self) -> float:
        """1 for a game won in the fewest guesses bisection may need, less 0.1 for each guess beyond that (at least
        0.1 for a win); 0 when the secret was not found."""
        if not self._solved:
            return 0.0
        best = max(1, (self._high - self._low).bit_length())
        return max(0.1, 1.0 - 0.1 * max(0, self._guesses - best))
