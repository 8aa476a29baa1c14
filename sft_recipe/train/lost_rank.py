"""A rank that dies outright (SIGKILL from the out-of-memory killer, a segfault, a lost machine) cannot say so. The
ranks that survive it learn it from the collective they are in: gloo's "Connection reset by peer", NCCL's aborted
communicator, a timeout. Each then ends with one line instead of a traceback: what happened, the likely cause, the
newest intact checkpoint and the resume command. Which rank died and of what signal is in the launcher's report
(torch's "Root Cause" block, printed next), and run_peft_*.sh repeats the resume line when the launch fails after a
checkpoint was written (scripts/lib/launch_common.sh).
"""

from __future__ import annotations

import contextlib
import re

# How torch's transports say that the other end of a collective is gone (gloo over TCP, NCCL, the store).
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|NCCL communicator was aborted"
                        r"|remote process exited|Socket Timeout|Connection refused|failed to recv|Timed out waiting",
                        re.IGNORECASE)


class LostRank(Exception):
    """Raised on a surviving rank with lost_rank_message; train.py prints it and exits 1."""


@contextlib.contextmanager
def lost_rank_said(rank: int, output_dir: str):
    """Inside, a collective that fails because another rank is gone becomes LostRank: the one line, with the newest
    intact checkpoint of `output_dir` and the resume command (training, the final save, the push)."""
    try:
        yield
    except RuntimeError as e:
        if not lost_a_rank(e):
            raise
        from sft_recipe.artifacts.checkpoints import intact_checkpoints

        newest = next(iter(intact_checkpoints(output_dir)), None)
        raise LostRank(lost_rank_message(rank, e, str(newest) if newest else None)) from None


def lost_a_rank(error: BaseException | None) -> bool:
    """Whether `error` (or what caused it) is a collective that failed because another rank is gone."""
    from sft_recipe.errors import error_chain, is_disk_full

    if is_disk_full(error):  # a full disk on some rank ends every rank with exit 74 (train.py), not this
        return False
    return any(type(e).__name__ == "DistBackendError" or (isinstance(e, RuntimeError) and _PEER_GONE.search(str(e)))
               for e in error_chain(error))


def lost_rank_message(rank: int, error: BaseException, newest_checkpoint: str | None,
                      before_training: bool = False) -> str:
    """One line for a surviving rank. `before_training`: it was lost in one of the collectives that come before
    (the data's preparation, the 4-bit state from rank 0, the trainer's set-up), where nothing was written."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    where = re.sub(r"^\[[^\]]*\]\s*", "", first)[:160]  # gloo prefixes its source file and line
    resume = ("Training had not started, nothing was written: run the same command again." if before_training else
              f"The newest intact checkpoint is {newest_checkpoint}: run the same command with "
              f"--resume_from_checkpoint latest." if newest_checkpoint else
              "No checkpoint was written yet: run the same command again.")
    return (f"rank {rank}: another rank is gone ({where}). Its process ended: killed (SIGKILL, usually the "
            f"out-of-memory killer: check `dmesg` or the job's memory) or crashed; the launcher's report names the "
            f"rank and its signal. {resume}")
