"""A bf16 frozen base for LoRA under bf16 mixed precision: the same run as upstream's fp32 load, at half the memory.

The checkpoint is the tiny model stored in bf16 (as Llama-2's is): an fp32 copy of it holds no information the bf16
one lacks, and under bf16 mixed precision the base only ever enters a matmul in bf16. Each engine trains both ways,
same seed and global batch, no dropout (--bf16 True: emulated on this CPU, fine at this size). Measured here, 5 steps:
- FSDP2: losses bit-identical; lora_B within 0.27% relative norm (FSDP2 casts every parameter to bf16 for compute);
- FSDP1: losses identical for 2 steps, then within 4.2e-4 relative; lora_B within 0.28%;
- one process: losses within 6.3e-4 relative, lora_B within 5.4%: autocast keeps an fp32 base's residual stream in
  fp32, a bf16 base's in bf16. That is the size of the difference between engines the suite already accepts (one
  process vs FSDP, both fp32 bases: lora_B 5.3%, losses 2e-3 at step 1), and the bf16 base lands closer to the
  sharded runs (lora_B 3.4-3.6% from them).
LoRA weights stay fp32 either way, and the base's live bytes per rank halve, as the plan says.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import launch_train

FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--max_steps", "5", "--logging_steps", "1", "--packing", "True",
         "--max_seq_len", "128", "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no", "--seed", "3",
         "--learning_rate", "3e-3", "--bf16", "True", "--chat_template_format", "none"]
ENGINES = {  # engine -> (accelerate config, extra flags); global batch 8 everywhere
    "single": ("cpu/single.yaml", ["--per_device_train_batch_size", "8"]),
    "fsdp1": ("cpu/fsdp_config.yaml", ["--per_device_train_batch_size", "4", "--use_reentrant", "True"]),
    "fsdp2": ("cpu/fsdp2_config.yaml", ["--per_device_train_batch_size", "4"]),
}
# engine -> (loss relative tolerance, lora_B relative-norm tolerance): about 2x what was measured (see above)
TOLERANCE = {"single": (1.5e-3, 0.1), "fsdp1": (1e-3, 0.01), "fsdp2": (0.0, 0.01)}


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-bf16")
    AutoModelForCausalLM.from_pretrained(str(tiny.model_dir), dtype=torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tiny.model_dir)).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def runs(bf16_checkpoint, tiny, tmp_path_factory):
    out = {}
    for engine, (config, extra) in ENGINES.items():
        for dtype in ("float32", "bfloat16"):
            flags = ["--model_name_or_path", str(bf16_checkpoint), "--dataset_name", str(tiny.jsonl_dir), *FLAGS,
                     *extra] + (["--torch_dtype", "float32"] if dtype == "float32" else [])  # bf16: the default
            result = launch_train(config, tmp_path_factory.mktemp(f"{engine}-{dtype}"), flags)
            assert result.returncode == 0, f"{engine} {dtype}:\n{result.output[-4000:]}"
            out[engine, dtype] = result
    return out


def _relative_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp_min(1e-12))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_bf16_base_trains_the_fp32_runs_numbers(runs, engine):
    fp32, bf16 = runs[engine, "float32"], runs[engine, "bfloat16"]
    assert fp32.record["run"]["config"]["model"]["torch_dtype"] == "float32"
    assert bf16.record["run"]["config"]["model"]["torch_dtype"] == "bfloat16"  # chosen by default for LoRA + bf16
    loss_tolerance, lora_b_tolerance = TOLERANCE[engine]
    a, b = fp32.record["training"]["losses"], bf16.record["training"]["losses"]
    assert len(a) == len(b) == 5
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert abs(x - y) <= loss_tolerance * abs(x), f"step {step}: {x} vs {y}"
    adapter_a = load_file(str(fp32.output_dir / "adapter_model.safetensors"))
    adapter_b = load_file(str(bf16.output_dir / "adapter_model.safetensors"))
    assert adapter_a.keys() == adapter_b.keys()
    assert {t.dtype for t in adapter_b.values()} == {torch.float32}  # LoRA weights stay fp32 over a bf16 base
    worst = max(_relative_norm(adapter_a[k], adapter_b[k]) for k in adapter_a if ".lora_B" in k)
    assert worst <= lora_b_tolerance, worst


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_base_weighs_half_on_every_rank_as_the_plan_says(runs, bf16_checkpoint, engine, monkeypatch):
    from sft_recipe.plan import model_shape

    fp32 = runs[engine, "float32"].record["memory"]
    bf16 = runs[engine, "bfloat16"].record["memory"]
    base_mib = model_shape(str(bf16_checkpoint)).total_params * 2 / 2 ** 20  # what halving the base saves: P x 2 B
    for key in ("weight_mib_after_load_per_rank", "weight_mib_after_wrap_per_rank"):
        for rank, (a, b) in enumerate(zip(fp32[key], bf16[key])):
            if a == 0:  # a rank that built the model on the meta device holds no weight after loading
                assert b == 0
                continue
            shards = 1 if key.endswith("load_per_rank") or engine == "single" else 2
            assert a - b == pytest.approx(base_mib / shards, rel=0.05), (key, rank, a, b)
