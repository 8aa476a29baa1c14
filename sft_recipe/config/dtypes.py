"""The dtype the base model loads in, decided from the flags and the checkpoint's own config."""

from __future__ import annotations

import torch

from sft_recipe.model.shape import DTYPES, checkpoint_dtype


def model_dtype(model_args) -> torch.dtype:
    """The dtype the base's weights are loaded in. 4-bit with a float storage dtype loads in that dtype (the guide's
    rule: FSDP flattens parameters of one dtype, so the packed 4-bit storage must match the rest of the model);
    otherwise `--torch_dtype` as parse_args resolved it (args.default_torch_dtype: bfloat16 for LoRA under bf16 mixed
    precision, else float32, upstream's), "auto" being the checkpoint's own dtype. LoRA weights and their optimizer
    state stay fp32 whatever the base's dtype."""
    storage = DTYPES[model_args.bnb_4bit_quant_storage_dtype]
    if model_args.use_4bit_quantization and storage.is_floating_point:
        return storage
    if model_args.torch_dtype == "auto":
        return checkpoint_dtype(model_args.model_name_or_path)
    return DTYPES.get(model_args.torch_dtype or "float32", torch.float32)
