"""What the command line and the recipe YAML gave (a flag chosen, its last value), and the defaults that depend on
the machine (bf16 only where a GPU has it): read from the raw argv, before and beside the dataclasses of args.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def hardware_defaults(argv: list[str], yaml_values: dict[str, Any], problems: list[str], launch) -> dict[str, Any]:
    """Defaults that depend on the machine, chosen here so that a CPU-only machine runs the recipe unchanged.

    TRL turns bf16 on by default; on a CPU it is emulated (~20x slower than fp32) and transformers refuses it
    unless `use_cpu` is set. So without a bf16 GPU the default becomes fp32; an explicit `--bf16 True` is kept
    (the guide's commands pass it) and runs on CPU when the CPU switch `ACCELERATE_USE_CPU=true` is on.
    """
    import torch

    defaults: dict[str, Any] = {}
    cpu_switch = launch.use_cpu
    bf16_gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if cpu_switch:
        defaults["use_cpu"] = True
    if not bf16_gpu and not explicitly_set(argv, yaml_values, "bf16"):
        defaults["bf16"] = False
    bf16_asked = value_of(argv, "bf16", yaml_values.get("bf16"))
    use_cpu_asked = cpu_switch or truthy(value_of(argv, "use_cpu", yaml_values.get("use_cpu")))
    if truthy(bf16_asked) and not bf16_gpu and not use_cpu_asked and launch.use_deepspeed:
        problems.append("--bf16 True: this machine has no GPU with bf16, and DeepSpeed runs on the CPU in fp32 only "
                        "(ACCELERATE_USE_CPU, the switch for bf16 on CPU, turns DeepSpeed off). Fix: --bf16 False.")
    elif truthy(bf16_asked) and not bf16_gpu and not use_cpu_asked:
        problems.append(
            "--bf16 True: this machine has no GPU with bf16. Fix: --bf16 False (fp32; bf16 on a CPU is emulated and "
            "~20x slower), or set ACCELERATE_USE_CPU=true (or --use_cpu True) to run bf16 on the CPU anyway."
        )
    return defaults


def value_of(argv: list[str], name: str, default: Any = None) -> Any:
    """The last value given for --name on the command line ('True' for a bare boolean flag)."""
    value = default
    for i, token in enumerate(argv):
        if token == f"--{name}":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = "True" if (not nxt or nxt.startswith("--")) else nxt
        elif token.startswith(f"--{name}="):
            value = token.split("=", 1)[1]
    return value


def truthy(value: Any) -> bool:
    return str(value).lower() in ("true", "1", "yes", "y") if value is not None else False


def explicitly_set(argv: list[str], config_values: dict[str, Any], name: str) -> bool:
    """Whether the user chose `name` (CLI or YAML) rather than leaving the library default."""
    return any(t == f"--{name}" or t.startswith(f"--{name}=") for t in argv) or name in config_values


def bitsandbytes_needed(argv: list[str]) -> bool:
    """Whether a run of train.py with `argv` may use bitsandbytes, read before the libraries load (True wherever that
    cannot be read: a Hub id, an unreadable recipe YAML or config.json). sft_recipe/compat/unused_imports.py
    says why a run that cannot use it should not import it."""
    from sft_recipe.config.packages import TABLE  # the settings and values that build something from bitsandbytes

    yaml_values = _recipe_yaml(argv)
    if yaml_values is None:
        return True
    for row in TABLE:
        if row.package != "bitsandbytes":
            continue
        setting = row.setting.lstrip("-")
        value = value_of(argv, setting, yaml_values.get(setting))
        if value is not None and (str(value) == row.value or (row.value == "True" and truthy(value))):
            return True
    model = value_of(argv, "model_name_or_path", yaml_values.get("model_name_or_path"))
    return model is None or _base_may_be_quantized(Path(str(model)))


def wandb_needed(argv: list[str]) -> bool:
    """Whether a run of train.py with `argv` may report to W&B (--report_to names wandb, or all, which transformers
    expands to what is installed), read before the libraries load (True where the recipe YAML cannot be read).
    sft_recipe/compat/unused_imports.py says why a run that does not should not import it."""
    return _may_report_to(argv, "wandb")


def mlflow_needed(argv: list[str]) -> bool:
    """Whether a run of train.py with `argv` may report to MLflow: as wandb_needed, for mlflow."""
    return _may_report_to(argv, "mlflow")


def _may_report_to(argv: list[str], reporter: str) -> bool:
    yaml_values = _recipe_yaml(argv)
    if yaml_values is None:
        return True
    value = value_of(argv, "report_to", yaml_values.get("report_to"))
    names = value if isinstance(value, list) else str(value or "").replace(",", " ").split()
    return any(str(name).strip() in (reporter, "all") for name in names)


def deepspeed_needed(argv: list[str], launched_on_deepspeed: bool) -> bool:
    """Whether a run of train.py with `argv` may use DeepSpeed: launched on it (config.launch_env.may_use_deepspeed)
    or given --deepspeed (a DeepSpeed JSON, the Trainer's own way in), read before the libraries load (True where the
    recipe YAML cannot be read). sft_recipe/compat/unused_imports.py says why a run that does not should not import
    it."""
    yaml_values = _recipe_yaml(argv)
    if launched_on_deepspeed or yaml_values is None:
        return True
    return bool(value_of(argv, "deepspeed", yaml_values.get("deepspeed")))


def _recipe_yaml(argv: list[str]) -> dict[str, Any] | None:
    """The `--config` recipe YAML's values ({} without one), or None where it cannot be read."""
    path = value_of(argv, "config")
    if path is None:
        return {}
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return values if isinstance(values, dict) else None


def _base_may_be_quantized(model_dir: Path) -> bool:
    """A local base whose config.json says it is quantized (or cannot be read) may need bitsandbytes to load."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or "quantization_config" in config
