"""The model's shape from its config, on the meta device: no weights read or allocated, so it costs the same for a
70B as for the tiny model. The ground floor that validation, loading, the adapter check, the resume check, merge and
the plan share; it imports nothing of the recipe.

- `read_config`: the one reader of a model's config in a run (read once per path; each caller gets its own copy).
- `config_dtype`: the one reader of the dtype a config says its weights are stored in.
- `meta_model`: the architecture built from that config on the meta device.
- `is_linear`, `features`: what counts as a linear layer (PEFT's rule: nn.Linear and transformers' Conv1D).
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache

import torch

# The dtype names the flags and configs use (--torch_dtype, --bnb_4bit_*_dtype, merge --dtype, config.json "dtype").
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


def _config_stamp(model_name_or_path: str) -> int | None:
    """config.json's modification time for a local folder (a rewritten config is read again), None for a Hub id."""
    try:
        return os.stat(os.path.join(model_name_or_path, "config.json")).st_mtime_ns
    except OSError:
        return None


@lru_cache(maxsize=32)
def _read_config(model_name_or_path: str, trust_remote_code: bool, stamp: int | None):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)


def read_config(model_name_or_path: str, trust_remote_code: bool = False):
    """The model's config (AutoConfig), read from disk or the Hub once per run and path. A copy: from_config and the
    loaders write into a config (its attention implementation, dtype), and no caller may see another's writes."""
    cached = _read_config(str(model_name_or_path), bool(trust_remote_code), _config_stamp(str(model_name_or_path)))
    return copy.deepcopy(cached)


def config_dtype(config, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a config says its weights are stored in: the text config's (a multimodal checkpoint nests it),
    else the top level's, else `default` (transformers 5 reads a config.json's legacy `torch_dtype` into `dtype`).
    Names such as "bfloat16" or "torch.bfloat16" are read as torch dtypes; a name torch does not know is unsaid."""
    for holder in (config.get_text_config(), config):
        value = getattr(holder, "dtype", None)
        if isinstance(value, str):
            value = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    return default


def checkpoint_dtype(model_name_or_path: str, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (float32 when it says none)."""
    return config_dtype(read_config(model_name_or_path, trust_remote_code))


def meta_model(model_name_or_path: str, trust_remote_code: bool = False):
    """The model's architecture on the meta device: built from its config alone, no weights read or allocated, so it
    costs the same for a 70B as for the tiny model. Used to check configurations and saved adapters. A new model each
    call: the adapter check injects LoRA layers into it."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import set_zero3_state

    config = read_config(model_name_or_path, trust_remote_code)
    # set_zero3_state() tells transformers zero.Init is already active: under DeepSpeed ZeRO-3, from_config would
    # otherwise build the model inside deepspeed.zero.Init, a collective (it broadcasts every parameter), and this
    # runs on the main process only (the adapter check): it would wait for the other ranks forever.
    with torch.device("meta"), set_zero3_state():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def module_names(model_name_or_path: str, trust_remote_code: bool) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in meta_model(model_name_or_path, trust_remote_code).named_modules()
            if name}


def is_linear(module) -> bool:
    """A layer PEFT's all-linear takes: nn.Linear, or transformers' Conv1D (GPT-2, GPT-SW3, ...: a linear whose
    weight is stored in x out)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def features(module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer of either kind."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.nf


def linear_module_names(model_name_or_path: str, trust_remote_code: bool) -> set[str]:
    """Leaf names of the model's linear layers (q_proj, gate_proj, ...), lm_head excluded, built on meta."""
    model = meta_model(model_name_or_path, trust_remote_code)
    output = model.get_output_embeddings()
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if is_linear(module) and module is not output}
