"""FSDP1 QLoRA loads the 4-bit base once (sft_recipe/train/quantized_from_rank0.py), decided and rebuilt without a
process group: the rule is the plan's; a rank that builds the model without weights gets the layout rank 0 loaded,
for the Llama demo, a tied model, two MoE styles, Gemma and a non-Llama layout; rank 0's quantization state rebuilt
from what it sends is byte for byte rank 0's. The broadcast itself runs in real processes:
tests/e2e/test_quantized_once.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from sft_recipe.config.args import ModelArguments
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.measure import quant_state_tensors, tensors_checksum
from sft_recipe.plan.inputs import Distribution
from sft_recipe.train.load_plan import quantized_base_from_rank0
from sft_recipe.train.model import bnb_config, model_without_weights
from sft_recipe.train.quantized_from_rank0 import (
    _batches,
    _install_placeholders,
    layout,
    layout_differences,
    make_4bit_layers,
)


def qlora_args(path: str = "unused", **overrides) -> ModelArguments:
    values = dict(model_name_or_path=path, use_peft_lora=True, use_4bit_quantization=True, use_nested_quant=True,
                  bnb_4bit_quant_storage_dtype="bfloat16", bnb_4bit_compute_dtype="float32", torch_dtype="bfloat16")
    return ModelArguments(**{**values, **overrides})


@pytest.mark.parametrize("version, efficient, quant, ranks", list(itertools.product(
    (1, 2), (True, False), ("4bit", "8bit", None), (1, 2, 8))))
def test_the_run_and_the_plan_agree_on_who_loads(version, efficient, quant, ranks):
    args = ModelArguments(model_name_or_path="x", use_4bit_quantization=quant == "4bit",
                          use_8bit_quantization=quant == "8bit")
    launch = LaunchEnv(world_size=ranks, use_fsdp=True, fsdp_version=version,
                       fsdp_cpu_ram_efficient_loading=efficient, fsdp_sync_module_states=efficient)
    plan = Distribution(kind="fsdp", num_processes=ranks, fsdp_version=version, cpu_ram_efficient_loading=efficient)
    assert quantized_base_from_rank0(args, launch) == plan.loads_quantized_base_once(quant)  # both ask one rule


@pytest.mark.parametrize("four_bit, version, efficient, ranks, once", [
    (True, 1, True, 2, True),    # the guide's FSDP1 QLoRA (fsdp_config_qlora.yaml) on 2 GPUs: rank 0 alone reads it
    (True, 1, True, 8, True),    # ... on 8
    (True, 1, True, 1, False),   # one rank: it is rank 0's own copy anyway
    (True, 1, False, 2, False),  # without cpu_ram_efficient_loading FSDP1 syncs nothing: every rank loads
    (True, 2, True, 2, False),   # FSDP2's preparation broadcasts no 4-bit weights (quantized_from_rank0.py says why)
    (True, None, True, 2, False),  # not FSDP (DDP, DeepSpeed)
    (False, 1, True, 2, False),  # a 16-bit base: accelerate's own rank-0 load, not this rule
])
def test_who_loads_a_4bit_base(four_bit, version, efficient, ranks, once):
    from sft_recipe.config.launch_env import loads_4bit_base_once

    assert loads_4bit_base_once(four_bit, version, efficient, ranks) is once


FAMILIES = ["llama", "qwen2", "mixtral", "deepseek-v3", "gemma3", "gpt-neox"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_weightless_rank_builds_the_layout_rank_0_loaded_and_takes_its_state(family, tiny, family_model):
    from transformers import AutoModelForCausalLM

    path = str(tiny.model_dir if family == "llama" else family_model(family))
    args = qlora_args(path)
    rank0 = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(args), dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    other = model_without_weights(args)
    make_4bit_layers(other, bnb_config(args))
    assert layout_differences(layout(other), layout(rank0)) == []
    assert other.is_loaded_in_4bit and other.is_quantized and other.config.quantization_config is not None
    assert (other.get_output_embeddings().weight is other.get_input_embeddings().weight) == \
        (rank0.get_output_embeddings().weight is rank0.get_input_embeddings().weight)  # tied where rank 0 is
    for batch in _batches(rank0):  # what rank 0 sends, received on this rank's device
        _install_placeholders(other, batch, torch.device("cpu"))
    assert layout_differences(layout(other), layout(rank0)) == []
    packed = {n: p for n, p in rank0.named_parameters() if getattr(p, "quant_state", None) is not None}
    placeholders = {n: p for n, p in other.named_parameters() if getattr(p, "quant_state", None) is not None}
    assert packed and placeholders.keys() == packed.keys()
    for name, weight in placeholders.items():
        assert weight.device.type == "meta" and weight.bnb_quantized
        assert (weight.shape, weight.dtype) == (packed[name].shape, packed[name].dtype)  # FSDP1 flattens these
    assert tensors_checksum(quant_state_tensors(other)) == tensors_checksum(quant_state_tensors(rank0))
    assert len(quant_state_tensors(other)) == len(quant_state_tensors(rank0))
    modules = dict(other.named_modules())
    assert all(modules[n.rsplit(".", 1)[0]].quant_state is w.quant_state for n, w in placeholders.items())


def test_a_layout_difference_names_the_tensor_and_both_sides():
    rank0 = [("a.weight", (4, 4), "4bit:torch.bfloat16"), ("b.bias", (4,), "torch.bfloat16")]
    mine = [("a.weight", (4, 4), "4bit:torch.float32")]
    problems = layout_differences(mine, rank0)
    assert problems == ["a.weight: rank 0 has [(4, 4), '4bit:torch.bfloat16'], this rank [(4, 4), "
                        "'4bit:torch.float32']", "b.bias: rank 0 has [(4,), 'torch.bfloat16'], this rank None"]
