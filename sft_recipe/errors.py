"""The error every layer raises for a user's mistake: the ground floor, importing nothing of the recipe."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the configuration. Carries every problem found, reported at once without a traceback
    (train.py and the side tools exit 2 with the list)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")
