"""train.py with one rank's disk full: tests/e2e/test_disk_full.py launches it instead of train.py, never by hand.

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp2_config.yaml \
        tests/e2e/disk_full_worker.py [train.py flags]

On rank 1 alone, writing its RNG state into checkpoint-2 raises ENOSPC, as a full local disk would -- a write only that
rank makes, after the collective shard writes, so the other ranks would otherwise go on to the next collective and
wait there. Everything else is train.py, run as `python train.py`.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sft_recipe.startup import prepare_imports  # noqa: E402

prepare_imports(sys.argv[1:])  # as train.py decides (sft_recipe/startup.py), before this imports the libraries

import sft_recipe.train.trainer as trainer_module  # noqa: E402

real_save_rng_state = trainer_module.save_rng_state


def full_on_rank_1(path) -> None:
    if os.environ.get("RANK") == "1" and "checkpoint-2" in str(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    real_save_rng_state(path)


trainer_module.save_rng_state = full_on_rank_1
sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
