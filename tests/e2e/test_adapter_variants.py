"""What the guide lists as untested or broken, made to work (or refused up front, see tests/unit/test_validate.py):

- the rows of the tokens chatml adds are trained and saved: PEFT trainable tokens in one process, `modules_to_save`
  (embed_tokens, lm_head) under FSDP2; both reload with the standard loaders and merge;
- 8-bit (paged) AdamW from bitsandbytes checkpoints and resumes exactly in one process.
"""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from tests.helpers import RELATIVE_TOLERANCE, TRAIN_FLAGS, launch_train


def _new_token_ids(out, tiny):
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(str(tiny.model_dir)).vocab_size
    return list(range(vocab, len(AutoTokenizer.from_pretrained(str(out)))))


def _merged_embedding_rows(out, tmp_path, ids):
    from transformers import AutoModelForCausalLM

    from sft_recipe.merge import merge_adapter

    merge_adapter(str(out), str(tmp_path / "merged"), log=lambda *a: None)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    return (merged.get_input_embeddings().weight[ids].detach(), merged.get_output_embeddings().weight[ids].detach())


def test_new_token_rows_train_in_one_process(tiny, tmp_path):
    out = tmp_path / "tokens"
    result = launch_train("cpu/single.yaml", out, [
        "--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
        "--chat_template_format", "chatml", "--train_new_tokens", "True", *TRAIN_FLAGS])
    assert result.returncode == 0, result.output[-6000:]
    assert "adapter check OK" in result.output and "keep random embedding" not in result.output
    ids = _new_token_ids(out, tiny)
    assert len(ids) == 3  # <|im_start|>, <|im_end|>, <pad>

    saved = load_file(str(out / "adapter_model.safetensors"))
    rows = {}
    for layer, key in (("embed", "model.embed_tokens"), ("head", "lm_head")):
        delta = saved[f"base_model.model.{key}.token_adapter.trainable_tokens_delta"]
        initial = saved[f"base_model.model.{key}.token_adapter.base_layer.weight"][ids]
        assert delta.shape == initial.shape == (3, 64)
        assert (delta - initial).abs().max() > 1e-3, f"{layer}: the new rows did not move"
        rows[layer] = delta

    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        torch.testing.assert_close(loaded.get_input_embeddings()(torch.tensor(ids)), rows["embed"])
    merged_embed, merged_head = _merged_embedding_rows(out, tmp_path, ids)
    torch.testing.assert_close(merged_embed, rows["embed"])
    torch.testing.assert_close(merged_head, rows["head"])


def test_modules_to_save_train_new_rows_under_fsdp2(tiny, tmp_path):
    out = tmp_path / "mts"
    result = launch_train("cpu/fsdp2_config.yaml", out, [
        "--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
        "--chat_template_format", "chatml", "--lora_modules_to_save", "embed_tokens,lm_head", *TRAIN_FLAGS])
    assert result.returncode == 0, result.output[-6000:]
    how = result.record["distribution"]
    assert how["distributed_type"] == "FSDP" and how["fsdp_version"] == 2
    assert "adapter check OK" in result.output
    ids = _new_token_ids(out, tiny)
    saved = load_file(str(out / "adapter_model.safetensors"))
    trained = {}
    for key in ("model.embed_tokens", "lm_head"):
        copy = saved[f"base_model.model.{key}.modules_to_save.weight"]
        original = saved[f"base_model.model.{key}.original_module.weight"]
        assert (copy[ids] - original[ids]).abs().max() > 1e-3, f"{key}: the new rows did not move"
        trained[key] = copy

    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(loaded.get_input_embeddings().weight, trained["model.embed_tokens"])
    merged_embed, merged_head = _merged_embedding_rows(out, tmp_path, ids)
    torch.testing.assert_close(merged_embed, trained["model.embed_tokens"][ids])
    torch.testing.assert_close(merged_head, trained["lm_head"][ids])


def test_8bit_paged_optimizer_checkpoints_and_resumes_in_one_process(tiny, tmp_path):
    # r=64: LoRA matrices of 64x64 = 4096 values reach bitsandbytes' 8-bit threshold (smaller ones stay 32-bit).
    flags = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *TRAIN_FLAGS,
             "--optim", "paged_adamw_8bit", "--lora_r", "64", "--save_strategy", "steps", "--save_steps", "4"]
    full = launch_train("cpu/single.yaml", tmp_path / "full", flags)
    assert full.returncode == 0, full.output[-6000:]
    state = load_file(str(tmp_path / "full" / "checkpoint-4" / "optimizer.safetensors"))
    assert any(key.endswith("state1") and value.dtype == torch.uint8 for key, value in state.items())

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", resumed_dir / "checkpoint-4")
    resumed = launch_train("cpu/single.yaml", resumed_dir, [*flags, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-6000:]
    a, b = full.record["training"]["losses"], resumed.record["training"]["losses"]
    for step in range(4, 8):
        assert abs(a[step] - b[step]) <= RELATIVE_TOLERANCE * abs(a[step]), (step + 1, a, b)
