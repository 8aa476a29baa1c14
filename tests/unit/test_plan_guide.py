"""The guide's runs inside the memory planner: the packaged setup against the shipped recipes and accelerate YAMLs
(so the two cannot drift), and the architectures the package ships.

The planner must run from an installed package, which has no recipes/ or configs/; these tests hold what it carries
equal to those files.
"""

from __future__ import annotations

import pytest

from sft_recipe.plan import guide_plans, parse_train_flags, plan_memory, read_accelerate_config
from sft_recipe.plan.guide import (
    FSDP_2_GPUS_OFFLOAD,
    FSDP_8_GPUS,
    GUIDE_RUNS,
    LORA_RECIPE,
    QLORA_RECIPE,
)
from tests.helpers import REPO

# Keys of the guide's shipped files that the planner does not read, which sft_recipe/plan/guide.py therefore leaves
# out. A key in neither the packaged setup nor these lists fails the drift test: decide whether it sizes memory.
UNPLANNED_RECIPE_KEYS = {
    "seed", "dataset_name", "add_special_tokens", "append_concat_token", "splits", "num_train_epochs",
    "logging_steps", "log_level", "logging_strategy", "eval_strategy", "save_strategy", "push_to_hub",
    "hub_private_repo", "hub_strategy", "learning_rate", "lr_scheduler_type", "weight_decay", "warmup_steps",
    "max_grad_norm", "output_dir", "per_device_eval_batch_size", "dataset_text_field", "lora_alpha",
}
UNPLANNED_ACCELERATE_KEYS = {
    "compute_environment", "debug", "downcast_bf16", "machine_rank", "main_training_function", "rdzv_backend",
    "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "fsdp_config.fsdp_auto_wrap_policy",
    "fsdp_config.fsdp_backward_prefetch", "fsdp_config.fsdp_forward_prefetch", "fsdp_config.fsdp_state_dict_type",
    "fsdp_config.fsdp_sync_module_states", "fsdp_config.fsdp_use_orig_params",
}
# run: (recipe, accelerate config, fsdp_offload_params as the guide ran it)
SHIPPED_GUIDE_RUNS = {
    "lora-8x80": ("recipes/llama2_70b_lora.yaml", "configs/fsdp_config.yaml", False),
    "qlora-2x24-offload": ("recipes/llama2_70b_qlora.yaml", "configs/fsdp_config_qlora.yaml", True),
    "qlora-2x24": ("recipes/llama2_70b_qlora.yaml", "configs/fsdp_config_qlora.yaml", False),
}


def _flat(mapping: dict, prefix: str = "") -> dict:
    """{"fsdp_config": {"x": 1}} -> {"fsdp_config.x": 1}: nested YAML keys compared one by one."""
    out = {}
    for key, value in mapping.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


@pytest.mark.parametrize("packaged, shipped, unplanned", [
    (LORA_RECIPE, "recipes/llama2_70b_lora.yaml", UNPLANNED_RECIPE_KEYS),
    (QLORA_RECIPE, "recipes/llama2_70b_qlora.yaml", UNPLANNED_RECIPE_KEYS),
    (FSDP_8_GPUS, "configs/fsdp_config.yaml", UNPLANNED_ACCELERATE_KEYS),
    (FSDP_2_GPUS_OFFLOAD, "configs/fsdp_config_qlora.yaml", UNPLANNED_ACCELERATE_KEYS),
], ids=["lora-recipe", "qlora-recipe", "fsdp-config", "fsdp-config-qlora"])
def test_the_packaged_guide_setup_is_what_the_shipped_files_say(packaged, shipped, unplanned):
    """The guide's runs ship inside the package (an installed planner has no recipes/ or configs/): each value there
    equals the shipped file's, and every other key of the file is one the planner does not read."""
    import yaml

    in_file = _flat(yaml.safe_load((REPO / shipped).read_text()))
    ours = _flat(packaged)
    assert ours == {key: in_file.get(key, "<not in the file>") for key in ours}
    assert set(in_file) - set(ours) <= unplanned, sorted(set(in_file) - set(ours) - unplanned)


def test_guide_plans_equal_the_plans_of_the_shipped_files():
    """Planned from the shipped recipe and accelerate YAML (as `--config_file ... --config ...` does), each of the
    guide's runs gives the packaged run's plan exactly, row for row."""
    plans = guide_plans()
    assert set(plans) == set(SHIPPED_GUIDE_RUNS)
    for key, (recipe, config, offload) in SHIPPED_GUIDE_RUNS.items():
        model_args, data_args, _, training_args = parse_train_flags(["--config", str(REPO / recipe)], "cuda")
        cfg = read_accelerate_config(REPO / config)
        cfg = {**cfg, "fsdp_config": {**cfg["fsdp_config"], "fsdp_offload_params": offload}}
        direct = plan_memory(model_args, data_args, training_args, cfg, None, GUIDE_RUNS[key].gpu_memory_gib,
                             "cuda", ladder=False)
        assert direct == plans[key], key


def test_the_planner_ships_the_architectures_it_plans_offline():
    """The Hub ids planned offline read their config from inside the package, and the plan names it so."""
    from sft_recipe.plan.shape import KNOWN_MODEL_CONFIGS, PACKAGE_DIR, resolve_model_config_dir

    for hub_id, folder in KNOWN_MODEL_CONFIGS.items():
        assert (folder / "config.json").is_file() and PACKAGE_DIR in folder.parents
        assert resolve_model_config_dir(hub_id) == (
            str(folder), f"architecture of {hub_id} from sft_recipe/plan/models/{folder.name} (offline copy)")
