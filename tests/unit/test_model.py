"""Tokenizer formats, embedding sizing, quantization config and dtype rules, LoRA config."""

import pytest
import torch

from sft_recipe.compat import strip_wrapper_segments
from sft_recipe.config.args import ModelArguments
from sft_recipe.config.dtypes import model_dtype
from sft_recipe.train.model import bnb_config, fit_embeddings_to_tokenizer, load_tokenizer, lora_config

MESSAGES = [{"role": "user", "content": "What is the opposite of hot?"},
            {"role": "assistant", "content": "The opposite of hot is cold."}]


@pytest.mark.parametrize("fmt,markers,eos", [
    ("chatml", ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    ("zephyr", ["<|user|>", "<|assistant|>"], "</s>"),
])
def test_chat_formats_add_single_special_tokens_and_template(tiny, fmt, markers, eos):
    base = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir)))
    tok = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format=fmt))
    assert len(tok) > len(base) and tok.eos_token == eos and tok.pad_token == "<pad>"
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for marker in markers:  # each marker is one token, not split into bytes
        assert marker in text and tok.convert_tokens_to_ids(marker) in ids
    mask = tok.apply_chat_template(MESSAGES, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(mask["input_ids"], mask["assistant_masks"]) if m]
    assert "The opposite of hot is cold." in tok.decode(masked)  # assistant-only loss can find the answer


def test_none_keeps_the_tokenizer_and_pads_with_eos(tiny):
    tok = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format="none"))
    from transformers import AutoTokenizer

    assert len(tok) == len(AutoTokenizer.from_pretrained(str(tiny.model_dir)))
    assert tok.pad_token == tok.eos_token and tok.chat_template


def test_embeddings_grow_to_exactly_the_tokenizer_never_padded(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    rows = model.get_input_embeddings().weight.shape[0]
    tok = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format="chatml"))
    assert fit_embeddings_to_tokenizer(model, tok)
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == rows + 3  # not rounded to a multiple of 8
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    assert not fit_embeddings_to_tokenizer(model, tok)  # already fits: untouched


def test_4bit_config_follows_the_flags():
    args = ModelArguments(use_4bit_quantization=True, use_nested_quant=True, bnb_4bit_compute_dtype="bfloat16",
                          bnb_4bit_quant_storage_dtype="bfloat16", bnb_4bit_quant_type="nf4")
    cfg = bnb_config(args)
    assert cfg.load_in_4bit and cfg.bnb_4bit_use_double_quant and cfg.bnb_4bit_quant_type == "nf4"
    assert cfg.bnb_4bit_compute_dtype == torch.bfloat16 and cfg.bnb_4bit_quant_storage == torch.bfloat16
    assert bnb_config(ModelArguments()) is None
    assert bnb_config(ModelArguments(use_8bit_quantization=True)).load_in_8bit


def test_model_dtype_equals_quant_storage_dtype_when_4bit():
    q = ModelArguments(use_4bit_quantization=True, bnb_4bit_quant_storage_dtype="bfloat16")
    assert model_dtype(q) == torch.bfloat16  # the guide's rule
    assert model_dtype(ModelArguments(use_4bit_quantization=True)) == torch.float32  # uint8 storage: not a dtype
    assert model_dtype(ModelArguments()) == torch.float32  # --bf16 is mixed precision over fp32 weights


def test_lora_config_targets():
    cfg = lora_config(ModelArguments(use_peft_lora=True, lora_r=8, lora_alpha=16, lora_target_modules="all-linear"))
    assert cfg.r == 8 and cfg.lora_alpha == 16 and cfg.target_modules == "all-linear"
    cfg = lora_config(ModelArguments(use_peft_lora=True, lora_target_modules="q_proj, v_proj"))
    assert set(cfg.target_modules) == {"q_proj", "v_proj"}
    assert lora_config(ModelArguments(use_peft_lora=False)) is None


def test_fsdp_wrapper_segments_are_stripped_anywhere_in_a_name():
    name = "_fsdp_wrapped_module.base_model.model.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp"
    assert strip_wrapper_segments(name) == "base_model.model.model.layers.0.mlp"
    assert strip_wrapper_segments("base_model.model.lm_head") == "base_model.model.lm_head"
