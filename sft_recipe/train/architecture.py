"""What a model family needs from the recipe, read from its config on the meta device (no weight is read).

- Attention: `--use_flash_attn True` asks for flash_attention_2 and is refused up front for a class transformers
  implements without it; otherwise transformers picks the best its class supports (SDPA where it exists, else eager:
  Gemma-2's soft-capped attention), said once in the log.
- What `all-linear` adapts: every nn.Linear but the output head (PEFT's own rule), except where PEFT 0.21 reaches
  further and breaks the run:
  * fused MoE experts (Mixtral, Qwen3-MoE on transformers 5 keep experts in 3-D parameters): PEFT adds the experts and
    the router through `target_parameters`, whose ParamWrapper raises on the guide's lora_dropout 0.1. Here
    `all-linear` is the attention and shared projections; experts are adapted only when named
    (`--lora_target_parameters`), the router never unless named.
  * multimodal checkpoints trained on text (Gemma-3 4B+, ...): only the language model's linears; a vision tower that
    sees no image gets no gradient, and its LoRA weights would stay zero (the adapter check fails after training).
- Tied input/output embeddings: which parameter names share one tensor.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from sft_recipe.config.args import ModelArguments

# Module names of the non-text parts of multimodal models in transformers 5 (vision/audio encoders, projectors).
NON_TEXT_PARTS = ("vision_tower", "vision_model", "visual", "audio_tower", "multi_modal_projector", "vision_embed")


def attention_implementation(model_args: ModelArguments) -> str | None:
    """flash_attention_2 when asked; None lets transformers choose the best its model class supports."""
    return "flash_attention_2" if model_args.use_flash_attn else None


@lru_cache(maxsize=16)
def _meta(model_name_or_path: str, trust_remote_code: bool):
    from sft_recipe.model_shape import meta_model

    return meta_model(model_name_or_path, trust_remote_code)


def model_class_name(model_name_or_path: str, trust_remote_code: bool = False) -> str:
    return type(_meta(model_name_or_path, trust_remote_code)).__name__


def flash_attention_problem(model_args: ModelArguments, trust_remote_code: bool = False) -> str | None:
    """Why --use_flash_attn True cannot work for this model's class, or None (the package is checked elsewhere)."""
    if not model_args.use_flash_attn:
        return None
    model = _meta(model_args.model_name_or_path, trust_remote_code)
    if getattr(type(model), "_supports_flash_attn", False):
        return None
    best = "SDPA" if getattr(type(model), "_supports_sdpa", False) else "eager"
    return (f"--use_flash_attn True: {type(model).__name__} ({model.config.model_type}) has no flash-attention "
            f"implementation in transformers. Fix: --use_flash_attn False ({best}, the best it supports).")


def attention_note(model) -> str:
    """The attention implementation the loaded model runs, and why."""
    used = getattr(model.config, "_attn_implementation", None) or "default"
    why = "asked with --use_flash_attn True" if used.startswith("flash") else \
        "transformers' choice for this model (--use_flash_attn False)"
    return f"attention: {used} for {type(model).__name__} ({why})"


def fused_expert_parameters(model) -> list[str]:
    """Names of fused MoE expert parameters (3-D: experts x out x in), e.g. `...mlp.experts.gate_up_proj`."""
    return [name for name, param in model.named_parameters() if param.dim() == 3]


def text_decoder_prefix(model) -> str:
    """Module-name prefix of a multimodal model's language part ("" for a text-only model): where the text config
    lives (`config.get_text_config()`), found as the module that does not belong to a vision/audio part."""
    if model.config.get_text_config() is model.config:
        return ""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for name, module in model.named_modules():
        if module is decoder:
            return name
    return ""


def _router_names(model) -> set[str]:
    """nn.Linear children of a block that also holds fused experts: the routers (and shared-expert gates)."""
    routers = set()
    for name, module in model.named_modules():
        if any(p.dim() == 3 for p in module.parameters(recurse=True)) and hasattr(module, "experts"):
            for child_name, child in module.named_children():
                if isinstance(child, torch.nn.Linear):
                    routers.add(f"{name}.{child_name}")
    return routers


def lora_targets(model_args: ModelArguments, trust_remote_code: bool = False) -> str | list[str]:
    """`target_modules` for the LoRA config: the flag's list, or what `all-linear` means for this model (see the
    module docstring): "all-linear" itself where PEFT's rule is right, else the explicit module names or pattern."""
    value = model_args.lora_target_modules.strip()
    if value != "all-linear":
        return [m.strip() for m in value.split(",") if m.strip()]
    if not model_args.model_name_or_path:
        return value
    model = _meta(model_args.model_name_or_path, trust_remote_code)
    prefix = text_decoder_prefix(model)
    if not prefix and not fused_expert_parameters(model):
        return value
    head = model.get_output_embeddings()
    routers = _router_names(model)
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear) and module is not head and name not in routers
                     and name.startswith(prefix) and not any(part in name.split(".") for part in NON_TEXT_PARTS)})
    if not prefix:
        return leaves
    # A full-match pattern (PEFT's rule for a string): the linears of the language model only.
    return rf"{re.escape(prefix)}\..*\.({'|'.join(leaves)})"


def lora_target_parameters(model_args: ModelArguments) -> list[str] | None:
    """`target_parameters` (PEFT's ParamWrapper over fused expert weights), only when named."""
    names = [p.strip() for p in getattr(model_args, "lora_target_parameters", "").split(",") if p.strip()]
    return names or None


def target_parameter_problems(model_args: ModelArguments, trust_remote_code: bool = False) -> list[str]:
    """--lora_target_parameters: each name must end a fused parameter of the model; PEFT 0.21's ParamWrapper
    applies no dropout, so --lora_dropout must be 0 with it."""
    names = lora_target_parameters(model_args)
    if not names or not model_args.use_peft_lora:
        return []
    problems = []
    if model_args.lora_dropout != 0:
        problems.append(f"--lora_target_parameters {','.join(names)} with --lora_dropout {model_args.lora_dropout}: "
                        "PEFT 0.21 adapts fused expert weights through ParamWrapper, which has no dropout and refuses "
                        "one (\"lora.ParamWrapper does not work with lora_dropout != 0\"). Fix: --lora_dropout 0, or "
                        "leave the experts out (all-linear then adapts attention and shared projections, with "
                        "dropout).")
    try:
        fused = fused_expert_parameters(_meta(model_args.model_name_or_path, trust_remote_code))
    except Exception:  # the model path is checked and named elsewhere
        return problems
    unknown = [n for n in names if not any(f == n or f.endswith("." + n) for f in fused)]
    if unknown:
        examples = sorted({f.split(".", 3)[-1] for f in fused})[:4] or ["(this model has no fused expert weights)"]
        problems.append(f"--lora_target_parameters: {unknown} name no fused expert parameter of "
                        f"{model_args.model_name_or_path}. Fix: names such as {examples}, or leave it empty.")
    return problems


def architecture_problems(model_args: ModelArguments, trust_remote_code: bool = False, launch=None) -> list[str]:
    """What this model's family cannot do as asked, found from its config before any weight loads."""
    try:
        problems = [p for p in [flash_attention_problem(model_args, trust_remote_code),
                                tied_training_problem(model_args, trust_remote_code, launch)] if p]
    except Exception:  # an unreadable config is named by the model-path checks
        return []
    return problems + target_parameter_problems(model_args, trust_remote_code)


def tied_training_problem(model_args: ModelArguments, trust_remote_code: bool = False, launch=None) -> str | None:
    """A tied embedding/head trained in full (--lora_modules_to_save) or by rows (--train_new_tokens) under FSDP2
    with cpu_ram_efficient_loading: accelerate 1.15 moves the model to the meta device and calls the model's
    `tie_weights()`, which fails on PEFT's wrappers ("attribute 'weight' already exists") after loading."""
    if launch is None or launch.requested_fsdp_version != 2 or not launch.cpu_ram_efficient_loading:
        return None
    saved = {m.strip() for m in model_args.lora_modules_to_save.split(",") if m.strip()}
    embedding_trained = bool(saved & {"embed_tokens", "lm_head", "wte", "embed_out"}) or model_args.train_new_tokens
    if not (model_args.use_peft_lora and embedding_trained and ties_embeddings(model_args, trust_remote_code)):
        return None
    return (f"{model_args.model_name_or_path} ties its output head to its input embedding, and training them "
            f"(--lora_modules_to_save {model_args.lora_modules_to_save or '-'}, --train_new_tokens "
            f"{model_args.train_new_tokens}) under FSDP2 with fsdp_cpu_ram_efficient_loading: true fails when "
            "accelerate 1.15 re-ties the weights after its meta-device move. Fix: fsdp_cpu_ram_efficient_loading: "
            "false in the accelerate config (every rank then reads the weights), or one process.")


def ties_embeddings(model_args: ModelArguments, trust_remote_code: bool = False) -> bool:
    """Whether the model's output head is its input embedding (Gemma, Llama-3.2, small Qwen)."""
    if not model_args.model_name_or_path:
        return False
    model = _meta(model_args.model_name_or_path, trust_remote_code)
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def tied_parameter_names(model) -> dict[str, str]:
    """{alias: first name} for every parameter registered under more than one name (a tied output head)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases
