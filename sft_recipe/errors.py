"""The error every layer raises for a user's mistake: the ground floor, importing nothing of the recipe."""

from __future__ import annotations

import errno
import re

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How safetensors' Rust writer and torch's C++ writers word ENOSPC (they raise no OSError).
_DISK_FULL_TEXT = re.compile(r"No space left on device|os error 28|Disk quota exceeded|os error 122")


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


class DiskFull(Exception):
    """A save ran out of space; raised on every rank (after artifacts.disk_full.guarded_save's agreement). train.py
    exits 74."""


def error_chain(error: BaseException | None):
    """`error`, its cause/context chain, and every rank's failure inside a DCP CheckpointException, each once."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
        stack += [e.__cause__, e.__context__]


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, its cause/context chain, or any rank's failure inside a DCP CheckpointException is ENOSPC."""
    for e in error_chain(error):
        if isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS):
            return True
        if not isinstance(getattr(e, "failures", None), dict) and _DISK_FULL_TEXT.search(str(e)):
            return True
    return False
