"""--adapter_name_or_path: train an existing LoRA adapter further (a local folder or a Hub id), with a new optimizer
and schedule -- not a resume of this run (that is --resume_from_checkpoint). LLaMA-Factory's `adapter_name_or_path`,
axolotl's `lora_model_dir`.

The adapter decides the LoRA shape: its saved config (rank, alpha, dropout, target modules, DoRA, modules trained in
full) becomes the LoraConfig TRL wraps the model with, and its weights are loaded into that model before any engine
wraps it, so one process, FSDP and DeepSpeed all start from the same tensors. A LoRA flag given on the command line
that disagrees with the adapter is refused before any weight loads (the adapter's value is what would be trained),
as is an adapter of another kind, of another base, or without its weights. A flag given at its default value cannot
be told from one left out (the parser keeps no record): there the adapter's value is taken, and the log names it. A
resume of a run that started from an adapter continues from its checkpoint, which holds the adapter as trained so
far.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# ModelArguments field -> LoraConfig attribute, for the flags the adapter's config decides.
SHAPE_FLAGS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "use_dora": "use_dora"}


def read_adapter_config(name_or_path: str):
    """The adapter's PEFT config (PeftConfig.from_pretrained: a folder or a Hub id)."""
    from peft import PeftConfig

    return PeftConfig.from_pretrained(name_or_path)


def start_adapter_problems(model_args, defaults) -> list[str]:
    """What stops a run from starting at --adapter_name_or_path, found before any weight loads. `defaults`: a
    ModelArguments with every default, to tell a flag the user gave from one left as it was."""
    path = getattr(model_args, "adapter_name_or_path", "")
    if not path:
        return []
    flag = f"--adapter_name_or_path {path}"
    try:
        config = read_adapter_config(path)
    except Exception as e:  # noqa: BLE001 -- no adapter_config.json, offline Hub id, a file of another library
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return [f"{flag}: no PEFT adapter could be read there ({type(e).__name__}: {first}). Fix: the folder a LoRA "
                "training saved (adapter_config.json and adapter_model.safetensors), or its Hub id."]
    problems = []
    kind = str(getattr(config, "peft_type", "")).split(".")[-1]
    if kind != "LORA":
        problems.append(f"{flag}: a {kind or 'non-LoRA'} adapter; this recipe trains LoRA/DoRA adapters. Fix: a LoRA "
                        "adapter, or leave the flag out.")
        return problems
    if not getattr(model_args, "use_peft_lora", False):
        problems.append(f"{flag} with --use_peft_lora False: the adapter is what would be trained. Fix: "
                        "--use_peft_lora True.")
    if Path(path).is_dir() and not any((Path(path) / name).is_file()
                                       for name in ("adapter_model.safetensors", "adapter_model.bin")):
        problems.append(f"{flag}: adapter_config.json is there but no adapter_model.safetensors: the weights to "
                        "continue from are missing. Fix: the whole adapter folder.")
    base = getattr(config, "base_model_name_or_path", None)
    if base and not _same_base(base, model_args.model_name_or_path):
        problems.append(f"{flag} was trained on {base}, but --model_name_or_path is {model_args.model_name_or_path}. "
                        f"Fix: --model_name_or_path {base} (or the same model's local folder).")
    for field_name, attribute in SHAPE_FLAGS.items():
        given, default, saved = getattr(model_args, field_name), getattr(defaults, field_name), getattr(config,
                                                                                                        attribute)
        if given != default and given != saved:
            problems.append(f"--{field_name} {given}, but the adapter at {path} has {saved}: its shape is what is "
                            f"trained further. Fix: drop --{field_name} (or give {saved}), or train a new adapter "
                            "without --adapter_name_or_path.")
    targets = getattr(model_args, "lora_target_modules", "")
    if targets != defaults.lora_target_modules and targets != "all-linear":
        wanted = {t.strip() for t in targets.split(",") if t.strip()}
        if wanted != set(config.target_modules or []):
            problems.append(f"--lora_target_modules {targets}, but the adapter at {path} adapts "
                            f"{sorted(config.target_modules or [])}. Fix: drop --lora_target_modules.")
    return problems


def _same_base(saved: str, given: str) -> bool:
    """The same model: the same name or path, or the same folder name (a Hub id and its local download)."""
    if saved == given:
        return True
    return Path(saved.rstrip("/")).name == Path(given.rstrip("/")).name


def start_lora_config(model_args, lora_config):
    """The LoraConfig to train with: the adapter's shape in place of the flags' (targets as it saved them)."""
    config = read_adapter_config(model_args.adapter_name_or_path)
    for attribute in ("r", "lora_alpha", "lora_dropout", "use_dora", "target_modules", "modules_to_save",
                      "target_parameters"):
        if hasattr(config, attribute):
            setattr(lora_config, attribute, getattr(config, attribute))
    logger.info(f"LoRA: the adapter at {model_args.adapter_name_or_path} decides the shape: r {lora_config.r}, alpha "
                f"{lora_config.lora_alpha}, dropout {lora_config.lora_dropout}, targets "
                f"{sorted(lora_config.target_modules or [])}{', DoRA' if lora_config.use_dora else ''}")
    return lora_config


def load_start_adapter(model, name_or_path: str) -> int:
    """Put the adapter's weights into `model` (TRL's PeftModel, before any engine wraps it). Returns how many
    tensors were loaded; raises when the adapter's tensors and the model's LoRA layers do not match."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    state = load_peft_weights(name_or_path, device="cpu")
    result = set_peft_model_state_dict(model, state)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise RuntimeError(f"--adapter_name_or_path {name_or_path}: {len(unexpected)} of its tensors match no LoRA "
                           f"layer of the model (e.g. {unexpected[:2]})")
    logger.info(f"LoRA: training the adapter at {name_or_path} further ({len(state)} tensors loaded), with a new "
                "optimizer and schedule (not a resume)")
    return len(state)
