"""TRL 1.16: its dataset preparation waits for every rank, so it cannot be run by one rank alone.

Gap: `SFTTrainer._prepare_dataset` runs its maps inside `trl.trainer.utils.global_then_local_main_first()`, whose
`PartialState.main_process_first` calls a barrier of all ranks. The recipe prepares the data on one process per
machine while the others wait for its result (data/prepared_copy.py): a barrier that only that process enters
would hang it, or pair with an unrelated collective of the others. `without_rank_barriers()` makes that ordering a
no-op for the recipe's own call (the recipe orders the ranks itself, by message, so that a problem found on the
preparing rank reaches every rank); the trainer's own preparation, which every rank runs, keeps TRL's.
When it can go: TRL offers preparation without the ordering (tests/unit/test_prepared_copy.py
::test_trl_preparation_still_orders_ranks fails on a TRL whose `_prepare_dataset` no longer enters it).
"""

from __future__ import annotations

import contextlib
from unittest import mock


@contextlib.contextmanager
def without_rank_barriers():
    """TRL's `global_then_local_main_first` replaced by a no-op inside the block."""
    with mock.patch("trl.trainer.sft_trainer.global_then_local_main_first", contextlib.nullcontext):
        yield
