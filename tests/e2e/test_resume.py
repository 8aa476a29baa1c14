"""Exact resume from sharded checkpoints: an interrupted run continued from its checkpoint matches one that never
stopped — losses of the remaining steps and the final adapter — on FSDP1 and FSDP2, with a 4-bit base.

LoRA on a 16/32-bit base resumes the same way elsewhere, so its cells here were dropped as duplicates (36 s of suite
time): FSDP1 and FSDP2 in tests/e2e/test_families.py (a tied Qwen2, `latest`), FSDP2 after a signal in
tests/e2e/test_faults.py, and across rank counts in tests/e2e/test_resume_other_ranks.py.

The uninterrupted runs are tests/e2e/test_train.py's QLoRA cells on FSDP1 and FSDP2 (tests/shared_runs.py: read, not
launched again). The "interrupted" run is the uninterrupted run's own checkpoint-4 copied into a fresh output_dir
and resumed with `--resume_from_checkpoint latest`, which must pick it (and skip a newer, incomplete checkpoint
planted beside it).
Both FSDP1 gaps of the current stack are exercised here: the adapter weights and the Adam moments used to be dropped.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import RELATIVE_TOLERANCE, launch_train
from tests.shared_runs import SHARED_LAUNCHES


@pytest.mark.parametrize("name", ["qlora-fsdp1", "qlora-fsdp2"])
def test_resume_matches_the_uninterrupted_run(name, tiny, shared_run, tmp_path):
    full = shared_run(name)  # tests/e2e/test_train.py's QLoRA cell, 8 steps with a checkpoint every 4
    assert full.returncode == 0, full.output[-5000:]

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full.output_dir / "checkpoint-4", resumed_dir / "checkpoint-4")
    (resumed_dir / "checkpoint-6").mkdir()  # a save killed half-way: no completion marker, must be skipped
    launch = SHARED_LAUNCHES[name]
    resumed = launch_train(launch.config, resumed_dir, [*launch.train_args(tiny), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-5000:]

    a, b = full.record["training"]["losses"], resumed.record["training"]["losses"]
    assert len(a) == len(b) == 8
    for step in range(4, 8):  # steps 5..8 were computed after the resume
        assert abs(a[step] - b[step]) <= RELATIVE_TOLERANCE * abs(a[step]), (step + 1, a, b)
    final_a = load_file(str(full.output_dir / "adapter_model.safetensors"))
    final_b = load_file(str(resumed_dir / "adapter_model.safetensors"))
    assert final_a.keys() == final_b.keys()
    for key in final_a:
        torch.testing.assert_close(final_b[key], final_a[key], rtol=RELATIVE_TOLERANCE, atol=1e-6, msg=key)
