"""Every shipped YAML is parsed and validated; the guide's two accelerate configs are exactly the guide's."""

from pathlib import Path

import pytest
import yaml

from sft_recipe.config.args import build_parser, known_option_names, parse_args, read_recipe_yaml
from tests.helpers import REPO

ACCELERATE_YAMLS = sorted((REPO / "configs").rglob("*.yaml"))
RECIPE_YAMLS = sorted((REPO / "recipes").rglob("*.yaml"))

# The guide's configs, key for key (PEFT "Use PEFT and FSDP").
GUIDE_COMMON = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
    "machine_rank": 0, "main_training_function": "main", "num_machines": 1, "rdzv_backend": "static",
    "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False,
}
GUIDE_FSDP = {
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE",
    "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False, "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_sync_module_states": True, "fsdp_use_orig_params": False,
}
GUIDE = {
    "fsdp_config.yaml": {**GUIDE_COMMON, "mixed_precision": "bf16", "num_processes": 8,
                         "fsdp_config": {**GUIDE_FSDP, "fsdp_offload_params": False}},
    "fsdp_config_qlora.yaml": {**GUIDE_COMMON, "mixed_precision": "no", "num_processes": 2,
                               "fsdp_config": {**GUIDE_FSDP, "fsdp_offload_params": True}},
}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_there_are_configs_and_recipes():
    names = {_rel(p) for p in ACCELERATE_YAMLS}
    assert {"configs/fsdp_config.yaml", "configs/fsdp_config_qlora.yaml", "configs/fsdp2_config.yaml",
            "configs/fsdp2_config_qlora.yaml", "configs/cpu/fsdp_config.yaml", "configs/cpu/fsdp2_config.yaml",
            "configs/cpu/single.yaml"} <= names
    assert RECIPE_YAMLS


@pytest.mark.parametrize("name", GUIDE)
def test_guide_configs_are_exactly_the_guides(name):
    assert yaml.safe_load((REPO / "configs" / name).read_text()) == GUIDE[name]


@pytest.mark.parametrize("path", ACCELERATE_YAMLS + RECIPE_YAMLS, ids=_rel)
def test_every_yaml_starts_with_the_command_it_is_for(path):
    head = path.read_text().splitlines()[:6]
    assert head[0].startswith("# "), "first line must say what the file is for"
    assert any("train.py" in line or "--config" in line for line in head), "header must give the exact command"


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=_rel)
def test_accelerate_configs_load_in_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))  # raises on keys accelerate does not know
    raw = yaml.safe_load(path.read_text())
    assert config.num_processes == raw["num_processes"]
    if raw["distributed_type"] == "FSDP":
        fsdp = raw["fsdp_config"]
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        if fsdp.get("fsdp_cpu_ram_efficient_loading") and fsdp.get("fsdp_version", 1) == 1:
            assert fsdp["fsdp_sync_module_states"], "the launcher refuses efficient loading without sync"
    if "/cpu/" in str(path):
        assert raw["use_cpu"] is True and raw["mixed_precision"] == "no"
        if raw["distributed_type"] == "FSDP" and raw["fsdp_config"].get("fsdp_version", 1) == 1:
            # FSDP1 cannot sync module states from CPU tensors ("requires them to be on GPU").
            assert raw["fsdp_config"]["fsdp_sync_module_states"] is False


@pytest.mark.parametrize("path", RECIPE_YAMLS, ids=_rel)
def test_recipes_have_only_known_keys_and_parse(path, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the GPU recipes ask for bf16
    values, problems = read_recipe_yaml(str(path), known_option_names(build_parser()))
    assert not problems and values
    parse_args(["--config", str(path), "--output_dir", str(tmp_path)])
