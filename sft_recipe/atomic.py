"""Files written in one step: a reader (a resume, a dashboard, a second process) sees the old file or the new one,
never half of one, and a full disk leaves no partial file behind. The ground floor: imports nothing of the recipe."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, write) -> None:
    """`write(tmp)` writes a sibling temporary file, which then replaces `path` in one step: never half-written."""
    tmp = path.with_name(f".{path.name}.writing-{os.getpid()}")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave the partial file (or its space) behind
        raise
    os.replace(tmp, path)
