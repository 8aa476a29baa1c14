"""--torch_dtype: the default the recipe picks (a bf16 base for LoRA under bf16 mixed precision), what validation
refuses, "auto", and trainable copies of a half-precision base trained in fp32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sft_recipe.config.args import ModelArguments, default_torch_dtype
from sft_recipe.config.dtypes import model_dtype
from sft_recipe.preflight.load_checks import dtype_problems
from sft_recipe.train.trainer import upcast_trainable_half_params

BF16, FP16, FP32 = (SimpleNamespace(bf16=True, fp16=False), SimpleNamespace(bf16=False, fp16=True),
                    SimpleNamespace(bf16=False, fp16=False))


@pytest.mark.parametrize("args, training, expected", [
    (dict(use_peft_lora=True), BF16, "bfloat16"),  # the frozen base only enters bf16 matmuls
    (dict(use_peft_lora=True, use_dora=True), BF16, "bfloat16"),
    (dict(use_peft_lora=True), FP32, "float32"),  # no mixed precision: upstream's fp32
    (dict(use_peft_lora=True), FP16, "float32"),  # fp16 mixed precision keeps upstream's fp32 (not measured here)
    (dict(use_peft_lora=False), BF16, "float32"),  # full fine-tuning trains the weights: fp32 master copy
    (dict(use_peft_lora=True, use_4bit_quantization=True, bnb_4bit_quant_storage_dtype="bfloat16"), BF16,
     "bfloat16"),  # 4-bit: its storage dtype, as before
    (dict(use_peft_lora=True, use_4bit_quantization=True), BF16, "float32"),  # uint8 storage: not a dtype
])
def test_the_default_base_dtype(args, training, expected):
    assert default_torch_dtype(ModelArguments(**args), training) == expected


def test_parse_args_resolves_the_default_and_keeps_an_explicit_choice(tiny):
    from sft_recipe.config.args import parse_args
    from sft_recipe.config.launch_env import LaunchEnv

    base = ["--model_name_or_path", str(tiny.model_dir), "--output_dir", "/tmp/unused", "--use_peft_lora", "True"]
    cpu = LaunchEnv(use_cpu=True)  # the CPU switch lets --bf16 True parse on a machine without a GPU
    assert parse_args([*base, "--bf16", "True"], cpu)[0].torch_dtype == "bfloat16"
    assert parse_args([*base, "--bf16", "True", "--torch_dtype", "float32"], cpu)[0].torch_dtype == "float32"
    assert parse_args([*base, "--bf16", "True", "--dtype", "float32"], cpu)[0].torch_dtype == "float32"  # alias
    assert parse_args([*base, "--bf16", "False"], cpu)[0].torch_dtype == "float32"


def test_validation_names_the_dtype_that_cannot_work():
    full = dtype_problems(ModelArguments(use_peft_lora=False, torch_dtype="bfloat16"), BF16)
    assert len(full) == 1 and "without LoRA" in full[0] and "--torch_dtype float32" in full[0]
    mismatch = dtype_problems(ModelArguments(use_peft_lora=True, torch_dtype="bfloat16"), FP32)
    assert len(mismatch) == 1 and "no mixed precision" in mismatch[0] and "--bf16 True" in mismatch[0]
    fp16_bf16 = dtype_problems(ModelArguments(use_peft_lora=True, torch_dtype="float16"), BF16)
    assert len(fp16_bf16) == 1 and "--bf16 True" in fp16_bf16[0] and "--fp16 True" in fp16_bf16[0]
    storage = dtype_problems(ModelArguments(use_peft_lora=True, use_4bit_quantization=True, torch_dtype="float32",
                                            bnb_4bit_quant_storage_dtype="bfloat16"), BF16)
    assert len(storage) == 1 and "storage dtype" in storage[0]
    assert dtype_problems(ModelArguments(use_peft_lora=True, torch_dtype="bfloat16"), BF16) == []
    assert dtype_problems(ModelArguments(use_peft_lora=True, torch_dtype="float32"), FP32) == []


def test_auto_is_the_checkpoints_own_dtype(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    assert model_dtype(ModelArguments(model_name_or_path=str(tiny.model_dir), torch_dtype="auto")) == torch.float32
    AutoModelForCausalLM.from_pretrained(str(tiny.model_dir), dtype=torch.bfloat16).save_pretrained(str(tmp_path))
    assert model_dtype(ModelArguments(model_name_or_path=str(tmp_path), torch_dtype="auto")) == torch.bfloat16


def test_trainable_copies_of_a_half_precision_base_train_in_fp32(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir), dtype=torch.bfloat16)
    peft_model = get_peft_model(model, LoraConfig(target_modules="all-linear", modules_to_save=["lm_head"]))
    trainable = {n: p.dtype for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable["base_model.model.lm_head.modules_to_save.default.weight"] == torch.bfloat16  # PEFT's copy
    assert upcast_trainable_half_params(peft_model) == 1  # only the copy: LoRA weights were fp32 already
    assert {p.dtype for p in peft_model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in peft_model.parameters() if not p.requires_grad} == {torch.bfloat16}  # the base stays


def test_activation_offloading_is_refused_where_it_cannot_work(monkeypatch):
    from sft_recipe.config.launch_checks import activation_offloading_problems
    from sft_recipe.config.launch_env import LaunchEnv

    asked = SimpleNamespace(activation_offloading=True, use_cpu=False)
    no_gpu = activation_offloading_problems(asked, LaunchEnv())
    assert len(no_gpu) == 1 and "needs a CUDA GPU" in no_gpu[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the decision on a GPU machine
    fsdp1 = LaunchEnv(world_size=2, use_fsdp=True, fsdp_version=1)
    fsdp2 = LaunchEnv(world_size=2, use_fsdp=True, fsdp_version=2)
    assert "under FSDP1" in activation_offloading_problems(asked, fsdp1)[0]
    assert "under DeepSpeed" in activation_offloading_problems(asked, LaunchEnv(world_size=2, use_deepspeed=True))[0]
    assert activation_offloading_problems(asked, fsdp2) == []
    assert activation_offloading_problems(asked, LaunchEnv()) == []  # one process
    assert activation_offloading_problems(SimpleNamespace(activation_offloading=False), fsdp1) == []
