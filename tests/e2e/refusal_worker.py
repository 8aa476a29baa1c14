"""train.py with ranks that refuse out of step, launched by tests/test_refusals_as_run.py in place of train.py:

    REFUSAL_WORKER=main-slow ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp2_config.yaml \
        tests/e2e/refusal_worker.py [train.py flags]

- main-slow: every rank refuses the same settings, and the main process reaches the checks 3 s after the others, as
  on a loaded machine (the others exit first: torchrun would SIGTERM the main process before its message).
- rank-1-alone: only rank 1 refuses (a problem only it sees); the main process goes on to its next collective.
Everything else is train.py, run as `python train.py`.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sft_recipe.startup import prepare_imports  # noqa: E402

prepare_imports(sys.argv[1:])  # as train.py decides (sft_recipe/startup.py), before this imports the libraries

import sft_recipe.preflight.validate as validate_module  # noqa: E402
from sft_recipe.errors import ConfigError  # noqa: E402

real_validate = validate_module.validate
MODE, RANK = os.environ["REFUSAL_WORKER"], os.environ.get("RANK")


def validate_out_of_step(*args, **kwargs) -> None:
    if MODE == "main-slow" and RANK == "0":
        time.sleep(3)
    if MODE == "rank-1-alone" and RANK == "1":
        raise ConfigError(["--output_dir: a problem only rank 1 sees (tests/e2e/refusal_worker.py)"])
    real_validate(*args, **kwargs)


validate_module.validate = validate_out_of_step
sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
