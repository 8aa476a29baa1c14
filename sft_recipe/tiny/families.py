"""Tiny random models of the families people fine-tune, built from transformers' own config classes.

Each is the demo's shape in miniature (2 decoder layers, hidden 64, the tiny tokenizer's vocabulary) with what makes
its family different kept: tied input/output embeddings (Llama-3.2, Qwen2/2.5/3 small, Gemma), Gemma-2's soft-capped
eager attention and sliding window, Gemma-3's nested text config and head_dim != hidden/heads, Phi-3's fused
projections, fused 3-D MoE experts (Mixtral, Qwen3-MoE; DeepSeek-V3 with its dense first layer, shared expert and
non-Linear router), and a non-Llama layout (GPT-NeoX). The family matrix
(tests/e2e/test_families.py) trains, saves, resumes and merges each under every engine.

    python -m sft_recipe.tiny --output_dir .tiny      # the tokenizer every family uses
    build_family_model(root, ".tiny", "qwen2")        # -> root/qwen2 (config, weights, tokenizer)
"""

from __future__ import annotations

from pathlib import Path

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)

# family -> (transformers config class, its arguments beyond SMALL, the model class for nested configs or None)
FAMILIES: dict[str, tuple[str, dict, str | None]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}, None),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True, "head_dim": 32}, None),  # Llama-3.2 1B/3B
    "mistral": ("MistralConfig", {"sliding_window": 64}, None),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}, None),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}, None),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "sliding_window": 64, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0}, None),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32, "sliding_window": 64}, None),
    "gemma3-multimodal": ("Gemma3Config", {}, "Gemma3ForConditionalGeneration"),  # text config nested
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}, None),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "decoder_sparse_step": 1, "head_dim": 32}, None),
    # DeepSeek-style MoE: a dense first layer, a router that is no nn.Linear (DeepseekV3TopkRouter: a bare 2-D
    # weight and a score-correction bias), a shared expert beside the fused routed ones, multi-head latent attention.
    "deepseek-v3": ("DeepseekV3Config", {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                                         "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_group": 1,
                                         "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                         "num_key_value_heads": 4}, None),
    "gpt-neox": ("GPTNeoXConfig", {"use_parallel_residual": True, "rotary_pct": 0.25}, None),
}


def family_config(family: str, vocab_size: int, bos_token_id: int = 1, eos_token_id: int = 2):
    """The family's config, in miniature."""
    import transformers

    class_name, extra, _ = FAMILIES[family]
    ids = dict(vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None)
    if family == "gemma3-multimodal":  # a text model inside a multimodal checkpoint's config
        text = family_config("gemma3", vocab_size, bos_token_id, eos_token_id)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                         **{k: v for k, v in ids.items() if k != "vocab_size"})
    return getattr(transformers, class_name)(**{**SMALL, **extra}, **ids)


def build_family_model(root, tiny_dir, family: str, seed: int = 0) -> Path:
    """A seeded random model of `family` with the tiny tokenizer, saved under root/<family> (built once)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_recipe.tiny.store import build_tiny

    out = Path(root) / family
    if (out / "config.json").is_file():
        return out
    build_tiny(Path(tiny_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_dir) / "model"))
    config = family_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model_class = FAMILIES[family][2]
    model = (getattr(transformers, model_class)(config) if model_class else
             AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    # Persistent buffers (DeepSeek-V3's router bias) start at zero: made non-zero, so that a rank which loaded
    # them wrong routes differently and trains another adapter.
    parameters = {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name not in parameters and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, dtype=tensor.dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out
