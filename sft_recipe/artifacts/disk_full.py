"""A full disk at a save ends every rank with one clear message and exit code 74, never a traceback or a hang.

What a full disk looks like depends on who writes: `safetensors` raises `SafetensorError` ("No space left on device
(os error 28)"), Python's own writes `OSError(ENOSPC)`, torch's distributed checkpoint (FSDP shards) a
`CheckpointException` (a BaseException) wrapping each failed rank's OSError -- on every rank, since DCP gathers the
results. A quota reached (EDQUOT) is the same situation with the same fix.

`guarded_save` runs one save and then has every rank agree on how it went, with one tiny all-gather that replaces the
barrier the save ended with: a rank whose own write failed (its RNG state, the main process's scheduler or adapter
files) no longer leaves the others waiting in the next collective until the launcher kills them. What the save left
half-written is never taken for whole: a checkpoint folder counts only once `mark_complete` wrote its marker (the
trainer marks after this agreement), the final adapter is written to a temporary folder that is removed here, and
`sft_recipe.atomic.write_atomically` removes its temporary sibling.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from sft_recipe.errors import DISK_FULL_ERRNOS, DiskFull, error_chain, is_disk_full

logger = logging.getLogger(__name__)

DISK_FULL_EXIT_CODE = 74  # EX_IOERR (sysexits.h): an input/output error, here a save that ran out of space
_CHECKPOINT = re.compile(r"^checkpoint-\d+$")
# torch.save (DeepSpeed's checkpoint files) reports a failed write without its errno: "[enforce fail at
# inline_container.cc:672] . unexpected pos 576 vs 534", from "basic_ios::clear: iostream error" (measured on a full
# tmpfs). Such a failure counts as a full disk when the disk then has less than this free.
_TORCH_WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+|iostream error|PytorchStreamWriter failed writing")
TORCH_WRITE_FULL_BELOW_BYTES = 64 * 2**20


class SaveFailedElsewhere(RuntimeError):
    """Another rank's part of a save failed (its own error is in its log): this rank stops too instead of waiting."""


def _torch_write_failed_on_a_full_disk(error: BaseException, folder) -> bool:
    if any(_TORCH_WRITE_FAILED.search(str(e)) for e in error_chain(error)):
        return free_bytes(folder)[1] < TORCH_WRITE_FULL_BELOW_BYTES
    return False


def free_bytes(path: str | os.PathLike) -> tuple[Path, int]:
    """(the nearest existing folder of `path`, bytes free there for this user)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def folder_bytes(path: str | os.PathLike) -> int:
    """Bytes the files under `path` take on disk (allocated blocks, as free space is counted; 0 where missing)."""
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    return sum(_allocated(p) for p in files)


def _allocated(path: Path) -> int:
    stat = path.stat()
    blocks = getattr(stat, "st_blocks", None)  # 512-byte units on every POSIX system
    return blocks * 512 if blocks is not None else stat.st_size


def guarded_save(accelerator, folder: str | os.PathLike, save, *, main_only: bool = False,
                 cleanup: str | os.PathLike | None = None, needed_bytes: int | None = None) -> None:
    """Collective: every rank calls it, in the same order as every other collective. Runs `save()` (on the main
    process alone with `main_only`), then every rank learns which ranks failed: a full disk anywhere raises DiskFull
    on every rank (the message built on the main process), another failure re-raises on its rank and raises
    SaveFailedElsewhere on the others. `cleanup`: a temporary folder of this save, removed on a full disk (never used,
    and it holds the space the next attempt needs); `needed_bytes`: what the save writes, for the message, where
    known. This is also the barrier the save ends with."""
    main = accelerator.is_main_process
    free_before = free_bytes(folder)[1] if main else 0
    error: BaseException | None = None
    if main or not main_only:
        try:
            save()
        except BaseException as e:
            # Ctrl-C and exits are not save failures (and reach every rank on their own); DCP's CheckpointException
            # is a BaseException that is one.
            if not (isinstance(e, Exception) or is_disk_full(e) or type(e).__name__ == "CheckpointException"):
                raise
            error = e
    full = error is not None and (is_disk_full(error) or _torch_write_failed_on_a_full_disk(error, folder))
    failed = _agree(accelerator, 1 if full else 2 if error is not None else 0)
    if not any(failed.values()):
        return
    if cleanup is not None and any(code == 1 for code in failed.values()):
        shutil.rmtree(cleanup, ignore_errors=True)
    if isinstance(error, DiskFull):  # a nested guarded save already explained it
        raise error
    if any(code == 1 for code in failed.values()):
        message = disk_full_message(folder, error if full else None, failed, free_before, needed_bytes) if main else \
            "see the main process's message"
        raise DiskFull(message) from None
    if error is not None:
        raise error
    ranks = ", ".join(str(rank) for rank, code in failed.items() if code)
    raise SaveFailedElsewhere(f"saving {folder} failed on rank {ranks} (its error is in its log)") from None


def _agree(accelerator, code: int) -> dict[int, int]:
    """{rank: 0 ok, 1 disk full, 2 other failure}, the same on every rank (one all-gather of one number each)."""
    if accelerator.num_processes <= 1:
        return {0: code}
    import torch

    codes = accelerator.gather(torch.tensor([code], device=accelerator.device))
    return {rank: int(value) for rank, value in enumerate(codes.tolist())}


def disk_full_message(folder: str | os.PathLike, error: BaseException | None, failed: dict[int, int],
                      free_before: int, needed_bytes: int | None = None) -> str:
    """The folder, what it needed and what was free, what was kept, and how to go on. `folder`: a checkpoint-N
    folder or the output_dir (the final adapter)."""
    from sft_recipe.artifacts.checkpoints import COMPLETE_MARKER, intact_checkpoints

    path = Path(folder)
    is_checkpoint = bool(_CHECKPOINT.match(path.name))
    output_dir = path.parent if is_checkpoint else path
    intact = intact_checkpoints(output_dir)
    ranks = [rank for rank, code in failed.items() if code == 1]
    where = f" on rank {', '.join(map(str, ranks))}" if len(failed) > 1 and ranks != list(failed) else ""
    reason = _first_line(error) if error is not None else "No space left on device"
    _, free_now = free_bytes(output_dir)
    if is_checkpoint:
        written = folder_bytes(path)
        needed = (f"a checkpoint takes {folder_bytes(intact[0]):,} bytes on disk ({intact[0].name})" if intact else
                  f"it needs more than the {written:,} bytes it wrote")
        what = f"writing {path.name}{where}"
        left = (f" {path.name} is incomplete (no {COMPLETE_MARKER}; {written:,} bytes): resuming skips it, and "
                "deleting it frees that space." if path.is_dir() else "")
    else:
        needed = (f"the adapter's tensors alone take {needed_bytes:,} bytes" if needed_bytes else
                  "the adapter did not fit")
        what = f"writing the final adapter{where}"
        left = " Nothing was replaced: the partly written adapter was removed."
    if intact:
        kept = (f"Kept: {intact[0].name}, the newest intact checkpoint (intact: "
                f"{', '.join(p.name for p in intact)}); `--resume_from_checkpoint latest` continues from it.")
        fix = ("Fix: free space there (or copy the output_dir to a bigger disk and point --output_dir at it), then run "
               "the same command with --resume_from_checkpoint latest; --save_total_limit N keeps only the newest N "
               "checkpoints.")
    else:
        kept = "No intact checkpoint was kept: this run's training is lost."
        fix = ("Fix: free space there or choose an --output_dir on a bigger disk, and run again (--save_total_limit N "
               "keeps only the newest N checkpoints).")
    return (f"--output_dir {output_dir}: the disk filled while {what} ({reason}): {needed}, and {free_before:,} were "
            f"free when the save started ({free_now:,} now).{left} {kept} {fix}")


def _first_line(error: BaseException) -> str:
    """The OSError's own words (the file it was writing), else the error's first line."""
    for e in error_chain(error):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return f"{e.strerror}: {e.filename}" if e.filename else str(e.strerror)
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def unguarded_disk_full(error: OSError) -> str:
    """The message for a full disk outside the guarded saves (the run record, the data report): the file, what is
    free, the newest intact checkpoint beside it."""
    from sft_recipe.artifacts.checkpoints import intact_checkpoints

    path = Path(error.filename) if error.filename else Path(".")
    folder, free_now = free_bytes(path.parent if error.filename else path)
    intact = intact_checkpoints(path.parent) if error.filename else []
    kept = (f" Kept: {intact[0].name}, the newest intact checkpoint; `--resume_from_checkpoint latest` continues "
            "from it." if intact else "")
    return (f"{error.filename or 'a file'}: {error.strerror} ({free_now:,} bytes free in {folder}).{kept} Fix: free "
            "space there or choose an --output_dir on a bigger disk, and run the same command again.")
