"""In-process pieces of the adapter-only save and the rank-0-only load (the launched runs are in tests/e2e)."""

from __future__ import annotations

import pytest
import torch

from sft_recipe.artifacts.gather import _owning_unit, adapter_state_keys
from sft_recipe.config.args import ModelArguments
from sft_recipe.config.launch_env import read_launch_env
from sft_recipe.train.load_plan import weights_arrive_from_rank0
from sft_recipe.train.model import materialize_meta_parameters, model_without_weights


def _peft(tiny, chat_template_format="none"):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.train.model import fit_embeddings_to_tokenizer, load_tokenizer, lora_config

    args = ModelArguments(model_name_or_path=str(tiny.model_dir), use_peft_lora=True, lora_r=2,
                          lora_target_modules="q_proj,v_proj", chat_template_format=chat_template_format)
    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    fit_embeddings_to_tokenizer(model, load_tokenizer(args))
    return get_peft_model(model, lora_config(args))


def test_adapter_keys_are_the_lora_tensors_in_the_full_namespace(tiny):
    keys = adapter_state_keys(_peft(tiny))
    assert keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in keys)
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)
    assert len(keys) == 2 * 2 * 2  # q/v x A/B x 2 layers


def test_a_resized_vocabulary_adds_the_embedding_and_head_rows(tiny):
    keys = adapter_state_keys(_peft(tiny, "chatml"))
    assert "base_model.model.model.embed_tokens.weight" in keys and "base_model.model.lm_head.weight" in keys
    assert not any("norm" in k or "q_proj.base_layer" in k for k in keys)  # nothing else of the base


def test_the_deepest_unit_owns_a_key():
    units = ["", "base_model.model.model.layers.0", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default",
             "base_model.model.model.layers.1"]
    assert _owning_unit("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", units) == units[2]
    assert _owning_unit("base_model.model.model.layers.0.mlp.up_proj.weight", units) == units[1]
    assert _owning_unit("base_model.model.model.layers.10.mlp.up_proj.weight", units) == ""  # not layers.1
    assert _owning_unit("base_model.model.lm_head.weight", units) == ""


@pytest.mark.parametrize("env,quantized,expected", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "LOCAL_RANK": "1"}, False, True),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "LOCAL_RANK": "0"}, False, False),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "LOCAL_RANK": "1"}, False, False),
    ({"ACCELERATE_USE_FSDP": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "LOCAL_RANK": "1"}, False, False),
    # 4-bit: accelerate 1.15 skips its rank-0 broadcast for Params4bit models, so every rank must quantize its own.
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "LOCAL_RANK": "1"}, True, False),
])
def test_only_other_ranks_of_an_efficient_load_skip_the_weights(tiny, env, quantized, expected):
    args = ModelArguments(model_name_or_path=str(tiny.model_dir), use_4bit_quantization=quantized)
    assert weights_arrive_from_rank0(args, read_launch_env(env)) is expected


def test_a_model_without_weights_keeps_real_buffers_and_gets_placeholder_storage(tiny):
    model = model_without_weights(ModelArguments(model_name_or_path=str(tiny.model_dir)))
    assert all(p.device.type == "meta" for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values())  # rotary frequencies: computed
    before = sum(1 for _ in model.parameters())
    assert materialize_meta_parameters(model) == before
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert len({p.data_ptr() for p in model.parameters()}) == before  # what accelerate's FSDP2 mapping relies on
    assert materialize_meta_parameters(model) == 0
    assert isinstance(next(model.parameters()), torch.nn.Parameter)
