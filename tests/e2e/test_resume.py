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

import json
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


def _logged_learning_rates(checkpoint) -> dict[int, float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["learning_rate"] for entry in history if "learning_rate" in entry}


def test_a_resume_follows_a_changed_learning_rate_and_weight_decay(tiny, shared_run, tmp_path):
    """The divergence stop's advice is a resume with a lower --learning_rate: the checkpoint's optimizer and
    scheduler state must not put the old rate back (they did: the resumed run trained at the old one, silently).
    FSDP2 (the optimizer's groups come back through DCP) with a 4-bit base: from the shared run's checkpoint-4 at
    --learning_rate 3e-3, on at 1e-3 with --weight_decay 0.1; every rate logged from step 5 on is the shared run's
    rate at that step times 1/3 (the same linear schedule, a third of the base)."""
    full = shared_run("qlora-fsdp2")
    assert full.returncode == 0, full.output[-5000:]
    launch = SHARED_LAUNCHES["qlora-fsdp2"]
    assert launch.flag("--learning_rate") == "3e-3" and launch.flag("--weight_decay") is None
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full.output_dir / "checkpoint-4", resumed_dir / "checkpoint-4")
    resumed = launch_train(launch.config, resumed_dir, [*launch.train_args(tiny), "--resume_from_checkpoint", "latest",
                                                         "--learning_rate", "1e-3", "--weight_decay", "0.1"])
    assert resumed.returncode == 0, resumed.output[-5000:]
    assert "resume: this launch's settings replace the checkpoint's: --learning_rate 0.003 -> 0.001, " \
           "--weight_decay 0 -> 0.1" in resumed.output, resumed.output[-5000:]
    before = _logged_learning_rates(full.output_dir / "checkpoint-8")
    after = _logged_learning_rates(resumed_dir / "checkpoint-8")
    assert sorted(after) == list(range(1, 9))  # steps 1-4 from the checkpoint's history, 5-8 trained here
    for step in range(1, 5):
        assert after[step] == before[step]  # the history is the checkpoint's
    for step in range(5, 9):
        assert abs(after[step] - before[step] / 3) <= 1e-9 * before[step], (step, before, after)
    # The weights moved differently from the uninterrupted run's: the new settings trained, not the old ones.
    losses_full, losses_resumed = full.record["training"]["losses"], resumed.record["training"]["losses"]
    assert abs(losses_resumed[4] - losses_full[4]) <= RELATIVE_TOLERANCE * abs(losses_full[4])  # step 5: same weights
    assert abs(losses_resumed[7] - losses_full[7]) > RELATIVE_TOLERANCE * abs(losses_full[7])
