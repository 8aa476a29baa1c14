"""A preempted job requeued on another allocation: resume a 2-rank FSDP checkpoint on 4 ranks, and a 4-rank one on
2, with the same global batch (2 sequences per rank x accumulation 2 on 2 ranks = 2 x 1 on 4 ranks).

One chain per FSDP version, through the real `accelerate launch` (--num_processes overrides the config's 2):
  A: 2 ranks, steps 1-6, checkpoints at 2, 4, 6       (the reference)
  B: 4 ranks, resumed from A's checkpoint-2, steps 3-6 (2 -> 4)
  C: 2 ranks, resumed from B's checkpoint-4, steps 5-6 (4 -> 2)
The resumed steps' losses and the final adapters must match A within the parity tolerance: weights and Adam state
reshard through DCP, the data order and the LR schedule follow the optimizer step. Random streams do not carry over
(rng_state per rank; the runs use no dropout, so nothing here depends on them).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import launch_train

RELATIVE_TOLERANCE = 1e-5  # as tests/e2e/test_parity.py
FLAGS = ["--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_alpha", "16",
         "--lora_dropout", "0", "--max_steps", "6", "--max_seq_len", "128", "--report_to", "none",
         "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no", "--logging_steps", "1",
         "--seed", "5", "--learning_rate", "3e-3", "--packing", "True", "--per_device_train_batch_size", "2",
         "--lr_scheduler_type", "linear"]
LAYOUTS = {2: ["--gradient_accumulation_steps", "2"], 4: ["--gradient_accumulation_steps", "1"]}


def _run(config, tiny, output_dir, ranks, extra=()):
    common = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *FLAGS]
    result = launch_train(config, output_dir, [*common, *LAYOUTS[ranks], *extra],
                          launcher_args=("--num_processes", str(ranks)))
    assert result.returncode == 0, result.output[-5000:]
    assert result.record["distribution"]["num_processes"] == ranks
    return result


def _resume(config, tiny, source, checkpoint, output_dir, ranks):
    output_dir.mkdir()
    shutil.copytree(source / checkpoint, output_dir / checkpoint)
    return _run(config, tiny, output_dir, ranks, ["--resume_from_checkpoint", "latest"])


@pytest.mark.parametrize("config", ["cpu/fsdp_config.yaml", "cpu/fsdp2_config.yaml"])
def test_resume_on_four_ranks_then_back_on_two(config, tiny, tmp_path):
    a = _run(config, tiny, tmp_path / "a", 2)
    b = _resume(config, tiny, tmp_path / "a", "checkpoint-2", tmp_path / "b", 4)
    assert "resuming on 4 ranks from a checkpoint of 2" in b.output
    c = _resume(config, tiny, tmp_path / "b", "checkpoint-4", tmp_path / "c", 2)
    reference = a.record["training"]["losses"]
    for run, first_resumed_step in ((b, 3), (c, 5)):
        losses = run.record["training"]["losses"]
        assert len(losses) == len(reference) == 6
        for step in range(first_resumed_step - 1, 6):
            assert abs(losses[step] - reference[step]) <= RELATIVE_TOLERANCE * abs(reference[step]), \
                (step + 1, reference, losses)
    final_a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    final_c = load_file(str(tmp_path / "c" / "adapter_model.safetensors"))
    assert final_a.keys() == final_c.keys()
    for key in final_a:
        torch.testing.assert_close(final_c[key], final_a[key], rtol=1e-4, atol=1e-5, msg=key)
