"""What the accelerate YAML sets against the model and the flags, before any weight loads: its keys and values
(config/launcher_yaml.py), the layer class it wraps, its precision and DeepSpeed's own values against the flags."""

from __future__ import annotations

import logging
import sys

from sft_recipe.config.launch_env import LaunchEnv

logger = logging.getLogger(__name__)

PRECISION_FLAGS = {"bf16": "--bf16 True", "fp16": "--fp16 True", "no": "--bf16 False --fp16 False"}


def launcher_yaml_problems(launch: LaunchEnv, script: str | None = None) -> list[str]:
    """Keys accelerate would drop or refuse in the YAML this run was launched with (found on the launcher's command
    line), and values it would not take."""
    from sft_recipe.config.launcher_yaml import find_launcher_yaml, yaml_problems

    found = find_launcher_yaml(launch.accelerate_launched, script or sys.argv[0])
    if found is None or found.path is None:
        return []
    return yaml_problems(found.values, found.path)


def flag_precision(t) -> str:
    """The mixed precision the flags ask for: transformers' TrainingArguments takes --fp16, then --bf16, and only when
    neither is on the launcher's ACCELERATE_MIXED_PRECISION (the YAML's mixed_precision)."""
    return "fp16" if getattr(t, "fp16", False) else "bf16" if getattr(t, "bf16", False) else "no"


def precision_problems(t, launch: LaunchEnv) -> list[str]:
    """One precision story. The rule: the flags decide. Where they name a precision, it is the run's, and a different
    one in the YAML is overridden (said in one line). Where they name none (fp32: --bf16 False --fp16 False, the
    recipe's default without a bf16 GPU) and the YAML names one, transformers would still autocast in the YAML's
    precision over a model the recipe loaded for fp32 training; with checkpointing the first backward fails
    ("Recomputed values ... have different metadata"): refused, naming both."""
    yaml_precision = launch.mixed_precision or "no"
    flags = flag_precision(t)
    if yaml_precision == flags:
        return []
    if flags == "no":
        return [f"mixed_precision: {yaml_precision} in the accelerate config (or `accelerate launch --mixed_precision "
                f"{yaml_precision}`) but the flags ask for fp32 ({PRECISION_FLAGS['no']}): transformers would autocast "
                f"in {yaml_precision} over a model loaded for fp32, and the first backward fails. Fix: "
                f"{PRECISION_FLAGS.get(yaml_precision, '--bf16 True')} to train in {yaml_precision}, or "
                "mixed_precision: 'no' in the accelerate config to train in fp32 (configs/cpu/*.yaml)."]
    if launch.is_main_process:
        logger.warning("mixed precision: %s, from %s; the accelerate config's mixed_precision: %s is overridden (the "
                       "flags decide, as transformers' TrainingArguments does).", flags, PRECISION_FLAGS[flags],
                       yaml_precision)
    return []


def deepspeed_value_problems(t, launch: LaunchEnv) -> list[str]:
    """DeepSpeed config values the flags also set: transformers refuses a mismatch once the model has loaded
    (`HfTrainerDeepSpeedConfig.trainer_config_process`: "values that mismatch TrainingArguments")."""
    if not launch.use_deepspeed or not launch.gradient_clipping or launch.gradient_clipping == "auto":
        return []
    try:
        clipping = float(launch.gradient_clipping)
    except ValueError:
        return [f"gradient_clipping: {launch.gradient_clipping!r} in the DeepSpeed config is not a number. Fix: a "
                "number, or remove it (the flag --max_grad_norm then sets it)."]
    if clipping != t.max_grad_norm:
        return [f"gradient_clipping: {clipping:g} in the DeepSpeed config but --max_grad_norm {t.max_grad_norm:g}: "
                "transformers refuses the mismatch once the model has loaded. Fix: --max_grad_norm "
                f"{clipping:g}, or remove gradient_clipping from the config (the flag then sets it)."]
    return []


def wrap_policy_problems(m, launch: LaunchEnv) -> list[str]:
    """A LoRA run is wrapped by PEFT's policy whatever the YAML says: transformers' Trainer replaces the plugin's
    policy with `peft.utils.other.fsdp_auto_wrap_policy` (`update_fsdp_plugin_peft`: a unit per decoder layer and per
    LoRA layer, which FSDP1 with use_orig_params false needs to keep trained and frozen weights in separate units).
    A NO_WRAP or SIZE_BASED_WRAP edit would be dropped in silence (tests/e2e/test_yaml_edits.py launches it and reads
    the units back): refused. A full fine-tune keeps the YAML's policy."""
    policy = launch.fsdp_auto_wrap_policy.upper()
    if not (launch.use_fsdp and m.use_peft_lora and policy in ("NO_WRAP", "SIZE_BASED_WRAP")):
        return []
    return [f"fsdp_auto_wrap_policy: {policy} with --use_peft_lora True: transformers' Trainer wraps a PEFT model with "
            "PEFT's own policy (a unit per decoder layer and per LoRA layer), so the edit would not take effect and "
            "the run would train as TRANSFORMER_BASED_WRAP. Fix: fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP "
            "(what runs; fewer, larger units are not available to a LoRA run), or a full fine-tune (--use_peft_lora "
            "False), which keeps the YAML's policy."]


def repeated_block_classes(model) -> list[str]:
    """Classes of the modules held in the model's ModuleLists: the repeated blocks a transformer wrap policy wraps,
    found from the module structure."""
    from torch import nn

    seen: dict[str, None] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                seen.setdefault(type(child).__name__)
    return list(seen)


def wrap_class_problems(m, t, launch: LaunchEnv) -> list[str]:
    """fsdp_transformer_layer_cls_to_wrap names classes accelerate looks up in the model when the trainer wraps it
    (`get_module_class_from_name`, after the weights have loaded: "Could not find the transformer layer class to
    wrap"). The same lookup, on the model's structure built on the meta device."""
    names = [n.strip() for n in launch.fsdp_transformer_layer_cls_to_wrap.split(",") if n.strip()]
    if not (launch.use_fsdp and names and launch.fsdp_auto_wrap_policy.upper() == "TRANSFORMER_BASED_WRAP"):
        return []
    from accelerate.utils.dataclasses import get_module_class_from_name

    from sft_recipe.model.shape import meta_model

    model = meta_model(m.model_name_or_path, bool(getattr(t, "trust_remote_code", False)))
    missing = [n for n in names if get_module_class_from_name(model, n) is None]
    if not missing:
        return []
    blocks = repeated_block_classes(model)
    default = [c for c in (getattr(model, "_no_split_modules", None) or []) if get_module_class_from_name(model, c)]
    return [f"fsdp_transformer_layer_cls_to_wrap: {', '.join(missing)}: {type(model).__name__} has no module of that "
            "class, and accelerate would stop after the weights have loaded (\"Could not find the transformer layer "
            f"class to wrap\"). Its repeated blocks are {', '.join(blocks) or 'none'}. Fix: "
            f"fsdp_transformer_layer_cls_to_wrap: {','.join(default or blocks)}, or remove the key (accelerate then "
            f"wraps the model's own no-split classes{': ' + ', '.join(default) if default else ''})."]
