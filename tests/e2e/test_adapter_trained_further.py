"""--adapter_name_or_path through real launches: the shared one-process LoRA run's final adapter (tests/shared_runs.py
`lora-single`, 8 steps) is trained further, on one process, FSDP1, FSDP2 and ZeRO-3 over 2 ranks (and the QLoRA
run's, `qlora-single`, on its 4-bit base under FSDP2). One step at rate 0 (a warmup's
first step; --learning_rate 0 is refused), and the adapter saved is the one loaded, tensor for tensor (its weights
were loaded before the engine wrapped the model, and saved in the same layout), and the first step's loss is the
trained adapter's, below the fresh run's first loss on the same first batch (same data, seed and flags)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import RELATIVE_TOLERANCE, launch_env, launch_train, run_command
from tests.shared_runs import SHARED_LAUNCHES


@pytest.mark.parametrize("engine", ["one process", "fsdp1", "fsdp2", "zero3"])
def test_an_adapter_trained_further_starts_from_its_weights(engine, tiny, shared_run, tmp_path):
    start = shared_run("lora-single")
    assert start.returncode == 0, start.output[-4000:]
    launch = SHARED_LAUNCHES["lora-single"]
    out = tmp_path / "further"
    flags = [*launch.train_args(tiny), "--adapter_name_or_path", str(start.output_dir), "--warmup_steps", "5",
             "--max_steps", "1", "--save_strategy", "no"]
    if engine == "one process":
        import sys

        from tests.helpers import REPO

        result = run_command([sys.executable, str(REPO / "train.py"), "--output_dir", str(out), *flags], out)
    elif engine == "zero3":  # DeepSpeed on CPU: gloo, fp32, without the CPU switch (tests/test_deepspeed.py)
        pytest.importorskip("deepspeed")
        result = launch_train("cpu/deepspeed_config.yaml", out, [*flags, "--ddp_backend", "gloo", "--bf16", "False"],
                              env=launch_env(cpu_switch=False))
    else:
        result = launch_train({"fsdp1": "cpu/fsdp_config.yaml", "fsdp2": "cpu/fsdp2_config.yaml"}[engine], out, flags)
    assert result.returncode == 0, result.output[-5000:]
    assert f"LoRA: training the adapter at {start.output_dir} further" in result.output
    before = load_file(str(start.output_dir / "adapter_model.safetensors"))
    after = load_file(str(out / "adapter_model.safetensors"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    first = result.record["training"]["losses"][0]
    fresh_first = start.record["training"]["losses"][0]  # the same batch through a fresh LoRA (lora_B = 0): the base
    assert first < fresh_first - 100 * RELATIVE_TOLERANCE * fresh_first, (first, fresh_first)


def test_a_qlora_adapter_trained_further_on_its_4bit_base_under_fsdp2(tiny, shared_run, tmp_path):
    start = shared_run("qlora-single")
    assert start.returncode == 0, start.output[-4000:]
    out = tmp_path / "further"
    flags = [*SHARED_LAUNCHES["qlora-single"].train_args(tiny), "--adapter_name_or_path", str(start.output_dir),
             "--warmup_steps", "5", "--max_steps", "1", "--save_strategy", "no", "--report_to", "none"]
    result = launch_train("cpu/fsdp2_config.yaml", out, flags)
    assert result.returncode == 0, result.output[-5000:]
    assert f"LoRA: training the adapter at {start.output_dir} further" in result.output
    assert result.record["run"]["quantization"] == "4bit"
    before = load_file(str(start.output_dir / "adapter_model.safetensors"))
    after = load_file(str(out / "adapter_model.safetensors"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    first, fresh_first = result.record["training"]["losses"][0], start.record["training"]["losses"][0]
    assert first < fresh_first - 100 * RELATIVE_TOLERANCE * fresh_first, (first, fresh_first)
