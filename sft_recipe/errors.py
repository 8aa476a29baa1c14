"""The error every layer raises for a user's mistake: the ground floor, importing nothing of the recipe."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the configuration. Carries every problem found, reported at once without a traceback
    (train.py and the side tools exit 2 with the list)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


def check_not_run(check: str, error: BaseException) -> None:
    """Say that a pre-load check could not run, and why, instead of letting it pass in silence: the launch goes on
    (another check names a bad model path or config, and the library fails loudly at load), the problems other
    checks found still stand. One WARNING line, named so that a user can tell which promise went unchecked."""
    import logging

    first = str(error).splitlines()[0] if str(error) else ""
    logging.getLogger("sft_recipe.checks").warning(
        f"{check} could not run ({type(error).__name__}{': ' + first if first else ''}); the launch goes on "
        "without it")
