"""The launcher's environment is read in one place, with accelerate's own rule for booleans."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sft_recipe.config.args import ConfigError
from sft_recipe.config.launch_env import LaunchEnv, read_launch_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
                                          ("0", False), ("false", False), ("no", False), ("", False)])
def test_booleans_follow_accelerates_rule(raw, expected):
    # FSDP_OFFLOAD_PARAMS=1 was true for one reader and false for two others before there was one reader.
    from accelerate.utils.environment import parse_flag_from_env

    launch = read_launch_env({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": raw})
    assert launch.fsdp_offload_params is expected
    if raw:  # accelerate's own reading of the same value agrees
        import os
        from unittest import mock

        with mock.patch.dict(os.environ, {"FSDP_OFFLOAD_PARAMS": raw}):
            assert parse_flag_from_env("FSDP_OFFLOAD_PARAMS") is expected


def test_hub_offline_is_read_as_huggingface_hub_reads_it():
    from huggingface_hub.constants import _is_true

    for raw in ("1", "true", "ON", "yes", "t", "y", "2", "", "0"):
        assert read_launch_env({"HF_HUB_OFFLINE": raw}).hub_offline is _is_true(raw), raw


def test_a_machine_without_local_world_size_counts_as_one_machine():
    launch = read_launch_env({"WORLD_SIZE": "4"})
    assert launch.local_world_size is None and launch.accelerate_config()["num_machines"] == 1
    assert read_launch_env({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).accelerate_config()["num_machines"] == 2


def test_a_value_accelerate_would_reject_is_named_with_its_fix():
    with pytest.raises(ConfigError) as e:
        read_launch_env({"ACCELERATE_USE_CPU": "maybe", "WORLD_SIZE": "two"})
    text = str(e.value)
    assert "ACCELERATE_USE_CPU='maybe': not a boolean. Fix:" in text and "WORLD_SIZE='two'" in text


def test_what_a_two_rank_fsdp_launch_exports():
    launch = read_launch_env({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                              "ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "true", "FSDP_VERSION": "2",
                              "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_STATE_DICT_TYPE": "sharded_state_dict"})
    assert not launch.is_main_process and launch.fsdp_on_cpu and launch.requested_fsdp_version == 2
    assert launch.cpu_ram_efficient_loading and launch.fsdp_state_dict_type == "SHARDED_STATE_DICT"
    config = launch.accelerate_config()
    assert config["distributed_type"] == "FSDP" and config["num_processes"] == 2
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert LaunchEnv().accelerate_config()["distributed_type"] == "NO"
    assert read_launch_env({}).requested_fsdp_version is None  # FSDP settings mean nothing without FSDP


def test_the_library_reads_the_process_environment_only_in_launch_env():
    readers = []
    for path in sorted((REPO / "sft_recipe").rglob("*.py")):
        if path.name == "launch_env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # os.environ[...] / os.environ.get / os.getenv; writes for child processes are not reads but none exist
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    for entry in ("train.py", "utils.py", "merge_adapter.py"):
        tree = ast.parse((REPO / entry).read_text())
        readers += [f"{entry}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and
                    n.attr in ("environ", "getenv")]
    assert readers == [], readers


def test_a_missing_model_names_the_flag_and_the_demo_recipe(tmp_path):
    from sft_recipe.config.args import parse_args
    from sft_recipe.preflight.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(*parse_args(["--output_dir", str(tmp_path / "o")]), LaunchEnv())
    assert "--model_name_or_path is required" in str(e.value) and "recipes/tiny_demo.yaml" in str(e.value)
