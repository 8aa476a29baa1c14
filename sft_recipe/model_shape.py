"""The model's shape from its config, on the meta device: no weights read or allocated, so it costs the same for a
70B as for the tiny model. The ground floor that validation, loading, the adapter check, the resume check, merge and
the plan share; it imports nothing of the recipe."""

from __future__ import annotations

import torch


def meta_model(model_name_or_path: str, trust_remote_code: bool = False):
    """The model's architecture on the meta device: built from its config alone, no weights read or allocated, so it
    costs the same for a 70B as for the tiny model. Used to check configurations and saved adapters."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import set_zero3_state

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    # set_zero3_state() tells transformers zero.Init is already active: under DeepSpeed ZeRO-3, from_config would
    # otherwise build the model inside deepspeed.zero.Init, a collective (it broadcasts every parameter), and this
    # runs on the main process only (the adapter check): it would wait for the other ranks forever.
    with torch.device("meta"), set_zero3_state():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def module_names(model_name_or_path: str, trust_remote_code: bool) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in meta_model(model_name_or_path, trust_remote_code).named_modules()
            if name}


def linear_module_names(model_name_or_path: str, trust_remote_code: bool) -> set[str]:
    """Leaf names of the model's linear layers (q_proj, gate_proj, ...), lm_head excluded, built on meta."""
    model = meta_model(model_name_or_path, trust_remote_code)
    output = model.get_output_embeddings()
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not output}
