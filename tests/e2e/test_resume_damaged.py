"""A damaged checkpoint never costs the run, and a resume with another LoRA shape is refused before any weight loads:
real checkpoints of one tiny run (the shared `lora-single`: one process, fp32), damaged in copies.

- `optimizer.safetensors` of the newest checkpoint truncated (its marker says complete): `latest` resumes from the
  one before, says which and why, moves the damaged one aside (nothing deleted) and finishes.
- An explicit path to it: exit 2, the intact checkpoints listed. `--lora_r 16` on an r 8 checkpoint: exit 2 naming
  both values, no weight loaded. The negative control for both: the same resume of the intact checkpoint trains.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from sft_recipe.artifacts.checkpoints import checkpoint_damage
from tests.helpers import launch_train, run_command
from tests.shared_runs import SHARED_LAUNCHES

CONFIG = "cpu/single.yaml"
SHARED = "lora-single"  # one process, fp32, 8 steps, r 8, checkpoints after steps 4 and 8 (tests/shared_runs.py)


@pytest.fixture(scope="module")
def trained(shared_run):
    run = shared_run(SHARED)
    assert run.returncode == 0, run.output[-4000:]
    return run.output_dir


def _copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _flags(tiny, *extra):
    """The shared run's flags, then the resume's."""
    return [*SHARED_LAUNCHES[SHARED].train_args(tiny), *extra]


def _train_py(tiny, out, *extra):
    """train.py in one process (no launcher): the refusals need no training."""
    return run_command([sys.executable, "train.py", "--output_dir", str(out), *_flags(tiny, *extra)], out)


def test_a_real_runs_checkpoints_are_intact(trained):
    assert [checkpoint_damage(trained / f"checkpoint-{step}") for step in (4, 8)] == [[], []]


def test_latest_skips_a_truncated_optimizer_and_the_run_finishes(tiny, trained, tmp_path):
    out = _copy(trained, tmp_path)
    optimizer = out / "checkpoint-8" / "optimizer.safetensors"
    with open(optimizer, "r+b") as f:
        f.truncate(1000)
    explicit = _train_py(tiny, out, "--max_steps", "10", "--resume_from_checkpoint", str(out / "checkpoint-8"))
    assert explicit.returncode == 2 and "Traceback" not in explicit.output, explicit.output[-3000:]
    assert f"--resume_from_checkpoint {out / 'checkpoint-8'}: damaged: optimizer.safetensors is 1,000 bytes" in \
        explicit.output and "(intact here: checkpoint-4)" in explicit.output

    resumed = launch_train(CONFIG, out, _flags(tiny, "--max_steps", "10", "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resuming from {out / 'checkpoint-4'}, the newest intact checkpoint; skipped as damaged: checkpoint-8 " \
           "(optimizer.safetensors is 1,000 bytes" in resumed.output
    assert resumed.record["training"]["global_steps"] == 10
    (aside,) = out.glob("_damaged-*")
    assert (aside / "checkpoint-8" / "optimizer.safetensors").stat().st_size == 1000  # kept, as it was
    assert checkpoint_damage(out / "checkpoint-8") == []  # the resumed run's own step 8


def test_another_lora_rank_is_refused_before_any_weight_loads(tiny, trained, tmp_path):
    out = _copy(trained, tmp_path)
    refused = _train_py(tiny, out, "--max_steps", "10", "--resume_from_checkpoint", "latest", "--lora_r", "16")
    assert refused.returncode == 2, refused.output[-3000:]
    assert f"--resume_from_checkpoint {out / 'checkpoint-8'} was trained with another LoRA shape (--lora_r 16 now, " \
           "8 in the checkpoint)" in refused.output and "Fix: the checkpoint's settings (--lora_r 8)" in refused.output
    assert "Loading weights" not in refused.output and "Traceback" not in refused.output
