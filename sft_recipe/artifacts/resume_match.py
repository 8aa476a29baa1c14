"""Is a checkpoint one this launch can continue? What a run trained -- its base model, its tokenizer's size, its LoRA
shape -- is recorded in every checkpoint's marker (`run_identity`) and compared with this launch's settings before
any weight loads (`resume_mismatch_problems`; the tokenizer once it is loaded: `tokenizer_size_problems`). Each
refusal names both values and the fix: the checkpoint's settings, or a fresh --output_dir. A checkpoint of an
earlier version, whose marker records no run, is compared through its adapter_config.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sft_recipe.artifacts.checkpoints import read_marker
from sft_recipe.artifacts.integrity import weights_fingerprint

# The architecture as config.json gives it. Not vocab_size: the run grows the embeddings to the tokenizer (chat-format
# tokens) and the config with them; the tokenizer's size is compared on its own, and the weights' fingerprint holds
# the embedding's shape as saved.
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size")
LORA_FLAGS = {"r": "--lora_r", "lora_alpha": "--lora_alpha", "target_modules": "--lora_target_modules",
              "target_parameters": "--lora_target_parameters", "use_dora": "--use_dora",
              "modules_to_save": "--lora_modules_to_save"}


def model_folder(name_or_path: str) -> Path | None:
    """The local folder of a model: the path itself, or a Hub id's snapshot in the local cache (None if neither)."""
    if not name_or_path:
        return None
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name_or_path, "config.json")
    except Exception:  # not a valid repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def _shape_value(text, key):
    try:
        return getattr(text, key, None)
    except RuntimeError:  # transformers 5.24: a per-layer attribute of a heterogeneous config refuses a global read
        return text.to_dict().get(key)  # what its config.json states globally (the per-layer overrides beside it)


def config_shape(config) -> dict:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = {key: _shape_value(text, key) for key in SHAPE_KEYS}
    shape["model_type"] = getattr(config, "model_type", None)
    return shape


def base_identity(name_or_path: str, config) -> dict:
    folder = model_folder(name_or_path)
    return {"name": name_or_path, "path": str(folder.resolve()) if folder else None, "shape": config_shape(config),
            "fingerprint": weights_fingerprint(folder) if folder else None}


def _suffixes(modules) -> list[str]:
    return sorted({str(name).rsplit(".", 1)[-1] for name in modules or ()})


def lora_identity(peft_config) -> dict:
    targets = peft_config.target_modules
    return {"r": peft_config.r, "lora_alpha": peft_config.lora_alpha,
            "target_modules": targets if isinstance(targets, str) else _suffixes(targets),
            "target_parameters": sorted(getattr(peft_config, "target_parameters", None) or []),
            "use_dora": bool(getattr(peft_config, "use_dora", False)),
            "modules_to_save": _suffixes(peft_config.modules_to_save)}


def run_identity(model, tokenizer) -> dict:
    """What the marker records of the run: base model (name, local path, shape, weights fingerprint), tokenizer size,
    LoRA shape (None: trained in full). `model` before any FSDP/DeepSpeed wrapping."""
    from peft import PeftModel

    peft = model if isinstance(model, PeftModel) else None
    base = peft.get_base_model() if peft is not None else model
    config = base.config
    lora = None
    if peft is not None:
        lora = lora_identity(peft.peft_config[peft.active_adapter])
    size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    return {"base": base_identity(getattr(config, "_name_or_path", "") or "", config), "tokenizer_size": size,
            "lora": lora}


def saved_run(checkpoint: str | os.PathLike) -> dict | None:
    """The marker's run record; for a checkpoint of an earlier version, what its adapter_config.json says (None where
    nothing is known)."""
    run = read_marker(checkpoint).get("run")
    if isinstance(run, dict):
        return run
    try:
        adapter = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    from types import SimpleNamespace

    fields = {"r": None, "lora_alpha": None, "target_modules": None, "target_parameters": None, "use_dora": False,
              "modules_to_save": None}
    lora = lora_identity(SimpleNamespace(**{k: adapter.get(k, v) for k, v in fields.items()}))
    return {"base": {"name": adapter.get("base_model_name_or_path")}, "lora": lora}


def _requested_targets(m, trust_remote_code: bool):
    """target_modules as this launch will give them to PEFT (suffixes, or a pattern); None where unknown."""
    from sft_recipe.model.shape import linear_module_names
    from sft_recipe.model.structure import lora_targets_of, parse_target_modules

    targets = parse_target_modules(m.lora_target_modules)  # a list is given to PEFT as it is: no model needed
    try:  # what all-linear means for this family
        if targets == "all-linear":
            targets = lora_targets_of(m.lora_target_modules, m.model_name_or_path, trust_remote_code).target_modules
        if targets == "all-linear":  # PEFT's rule: every linear layer but the output layer
            targets = linear_module_names(m.model_name_or_path, trust_remote_code)
    except Exception:  # an unreadable config is reported by validate's own checks
        return None
    return targets if isinstance(targets, str) else _suffixes(targets)


def _requested_lora(m, trust_remote_code: bool) -> dict:
    from sft_recipe.model.structure import parse_target_parameters

    names = parse_target_parameters(getattr(m, "lora_target_parameters", ""))
    return {"r": m.lora_r, "lora_alpha": m.lora_alpha, "target_modules": _requested_targets(m, trust_remote_code),
            "target_parameters": sorted(names), "use_dora": bool(m.use_dora),
            "modules_to_save": _suffixes(m.modules_to_save)}


def _flag_value(value) -> str:
    if isinstance(value, list):
        return ",".join(value) or "''"
    return str(value)


def _differs(then, now) -> bool:
    """A recorded value against this launch's; a pattern of target modules is not compared with a list of names."""
    if then is None or now is None or isinstance(then, str) != isinstance(now, str):
        return False
    return then != now


def lora_problems(checkpoint: str, saved: dict | None, m, trust_remote_code: bool) -> list[str]:
    fresh = "or a fresh --output_dir to train with this launch's settings from the start"
    if saved is None:
        if not m.use_peft_lora:
            return []
        return [f"--resume_from_checkpoint {checkpoint} holds no LoRA adapter (it was trained in full), but "
                f"--use_peft_lora is True. Fix: --use_peft_lora False (the checkpoint's), {fresh}."]
    if not m.use_peft_lora:
        return [f"--resume_from_checkpoint {checkpoint} holds a LoRA adapter (r {saved.get('r')}), but --use_peft_lora "
                f"is False. Fix: --use_peft_lora True with the checkpoint's LoRA settings, {fresh}."]
    now = _requested_lora(m, trust_remote_code)
    differ = [key for key in LORA_FLAGS if _differs(saved.get(key), now[key])]
    if not differ:
        return []
    said = "; ".join(f"{LORA_FLAGS[k]} {_flag_value(now[k])} now, {_flag_value(saved[k])} in the checkpoint"
                     for k in differ)
    theirs = " ".join(f"{LORA_FLAGS[k]} {_flag_value(saved[k])}" for k in differ)
    return [f"--resume_from_checkpoint {checkpoint} was trained with another LoRA shape ({said}), so resuming would "
            f"not continue that training. Fix: the checkpoint's settings ({theirs}), {fresh}."]


def _same_place(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def base_problems(checkpoint: str, saved: dict | None, m, trust_remote_code: bool) -> list[str]:
    saved = saved or {}
    then, now_name = saved.get("name"), m.model_name_or_path
    if not then or then == now_name and "shape" not in saved:
        return []
    now_folder = model_folder(now_name)
    fix = (f"Fix: --model_name_or_path {then} (the checkpoint's base), or a fresh --output_dir to train on "
           f"{now_name} from the start.")
    head = f"--resume_from_checkpoint {checkpoint} was trained on {then}, but --model_name_or_path is {now_name}"
    if "shape" in saved:  # recorded by this version
        try:
            from sft_recipe.model.shape import read_config

            now_shape = config_shape(read_config(now_name, trust_remote_code))
        except Exception:  # an unreadable config is reported by validate's own checks
            return []
        differ = [k for k in SHAPE_KEYS if saved["shape"].get(k) != now_shape.get(k)]
        if differ:
            what = ", ".join(f"{k} {saved['shape'].get(k)} there, {now_shape.get(k)} here" for k in differ)
            return [f"{head}, another model ({what}). {fix}"]
        then_print = saved.get("fingerprint")
        now_print = weights_fingerprint(now_folder) if now_folder and then_print else None
        if then_print and now_print:
            if then_print == now_print:
                return []
            return [f"{head}: the same architecture with other weights (their sampled tensors differ: another variant "
                    "or fine-tune of it, or the same model saved in another dtype). " + fix]
        same = _same_place(saved.get("path"), str(now_folder) if now_folder else None) or then == now_name
        return [] if same else [f"{head} (their weights cannot be compared here). {fix}"]
    # A checkpoint of an earlier version: only its adapter_config.json's base name is known.
    then_folder = model_folder(then)
    if then_folder and now_folder:
        if _same_place(str(then_folder), str(now_folder)):
            return []
        a, b = weights_fingerprint(then_folder), weights_fingerprint(now_folder)
        return [f"{head}, whose weights differ. {fix}"] if a and b and a != b else []
    if not then_folder and not now_folder and not then.startswith((".", "/")) and not now_name.startswith((".", "/")):
        return [f"{head}. {fix}"]  # two Hub ids
    return []


def resume_mismatch_problems(checkpoint: str | None, m, trust_remote_code: bool = False) -> list[str]:
    """The checkpoint's base model and LoRA shape against this launch's (no weights read)."""
    if not checkpoint:
        return []
    saved = saved_run(checkpoint)
    if saved is None:
        return []
    problems = base_problems(checkpoint, saved.get("base"), m, trust_remote_code)
    if "lora" in saved:
        problems += lora_problems(checkpoint, saved["lora"], m, trust_remote_code)
    return problems


def tokenizer_size_problems(checkpoint: str | None, tokenizer) -> list[str]:
    """The tokenizer this launch built (with its chat-format tokens) against the one the checkpoint was trained with:
    another size means other embedding rows, and other token ids for the same text."""
    if not checkpoint:
        return []
    then = (saved_run(checkpoint) or {}).get("tokenizer_size")
    now = len(tokenizer)
    if not then or then == now:
        return []
    return [f"--resume_from_checkpoint {checkpoint} was trained with a tokenizer of {then} tokens; this launch's has "
            f"{now} (the base's tokenizer and --chat_template_format, which adds tokens, decide it). Fix: the "
            "checkpoint's --model_name_or_path and --chat_template_format, or a fresh --output_dir to train with this "
            "tokenizer from the start."]
