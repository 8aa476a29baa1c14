"""The accelerate YAML read before any weight loads (sft_recipe/config/launcher_yaml.py,
sft_recipe/preflight/launcher_checks.py): keys and values as the installed accelerate takes them, the launcher found
on the parent's command line, the layer class to wrap in each family's structure, one precision story, DeepSpeed's
own values against the flags. Through the real launcher: tests/e2e/test_yaml_edits.py."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from sft_recipe.config.args import ModelArguments
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.config.launcher_yaml import find_launcher_yaml, launcher_arguments, main, yaml_problems
from sft_recipe.preflight.launcher_checks import (
    deepspeed_value_problems,
    precision_problems,
    wrap_class_problems,
    wrap_policy_problems,
)
from tests.helpers import REPO

CPU_FSDP1 = yaml.safe_load((REPO / "configs/cpu/fsdp_config.yaml").read_text())


def edited(section: str | None, **changes) -> dict:
    """The CPU twin of the engine `section` configures (FSDP1 for the top level), with `changes` made."""
    name = "deepspeed_config" if section == "deepspeed_config" else "fsdp_config"
    values = yaml.safe_load((REPO / f"configs/cpu/{name}.yaml").read_text())
    (values[section] if section else values).update(changes)
    return values


def test_every_shipped_accelerate_yaml_has_only_keys_and_values_accelerate_takes():
    paths = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(paths) >= 15
    for path in paths:
        assert yaml_problems(yaml.safe_load(path.read_text()), path) == [], path


@pytest.mark.parametrize("section, key, nearest", [
    ("fsdp_config", "fsdp_sharding_stratgy", "fsdp_sharding_strategy"),
    ("fsdp_config", "sharding_stratgy", "fsdp_sharding_strategy"),  # accelerate prefixes fsdp_ keys itself
    ("fsdp_config", "fsdp_transformer_layer_cls_to_warp", "fsdp_transformer_layer_cls_to_wrap"),
    ("fsdp_config", "fsdp_use_orig_param", "fsdp_use_orig_params"),
    ("deepspeed_config", "zero_stag", "zero_stage"),
    ("deepspeed_config", "offload_optimizer_devise", "offload_optimizer_device"),
    (None, "mixed_precission", "mixed_precision"),
    (None, "num_process", "num_processes"),
])
def test_a_misspelt_key_is_named_with_the_nearest_known_one(section, key, nearest):
    problems = yaml_problems(edited(section, **{key: "x"}) if section else {**CPU_FSDP1, key: "x"}, "edit.yaml")
    assert len(problems) == 1, problems
    assert f"`{section + '.' if section else ''}{key}` is not a key accelerate knows" in problems[0]
    assert f"Did you mean `{nearest}`?" in problems[0]


def test_a_key_nothing_is_near_is_named_without_a_guess():
    problems = yaml_problems(edited("fsdp_config", zzz=1), "edit.yaml")
    assert len(problems) == 1 and "`fsdp_config.zzz`" in problems[0] and "Did you mean" not in problems[0]


@pytest.mark.parametrize("section, key, value, says", [
    ("fsdp_config", "fsdp_version", True, "one of 1, 2"),  # YAML's TRUE: the KeyError 'TRUE' of issue 51
    ("fsdp_config", "fsdp_version", 3, "one of 1, 2"),
    ("fsdp_config", "fsdp_offload_params", "maybe", "is not a boolean"),
    ("fsdp_config", "fsdp_min_num_params", "1e8x", "is not a whole number"),
    ("deepspeed_config", "zero_stage", "three", "is not a whole number"),
    ("deepspeed_config", "gradient_clipping", "one", "is not a number"),
    (None, "mixed_precision", "bf32", "one of no, fp16, bf16, fp8"),
    (None, "num_processes", "two", "is not a whole number"),
])
def test_a_value_accelerate_would_not_take_is_named_with_what_it_takes(section, key, value, says):
    problems = yaml_problems(edited(section, **{key: value}) if section else {**CPU_FSDP1, key: value}, "e.yaml")
    assert len(problems) == 1, problems
    assert f"{section + '.' if section else ''}{key}: {value!r}" in problems[0] and says in problems[0]


def test_every_mistake_of_one_file_is_listed_at_once_by_the_command(tmp_path, capsys):
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(edited("fsdp_config", fsdp_sharding_stratgy="NO_SHARD", fsdp_version="TRUE")))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "2 configuration problem(s)" in err and "fsdp_sharding_stratgy" in err and "fsdp_version" in err
    assert main([str(REPO / "configs/fsdp_config.yaml")]) == 0


@pytest.mark.parametrize("parent, config_file, processes", [
    (["/v/bin/python", "/v/bin/accelerate", "launch", "--config_file", "c.yaml", "--num_processes", "2", "train.py",
      "--lora_r", "8"], "c.yaml", 2),
    (["python", "-m", "accelerate.commands.launch", "--config_file=c.yaml", "train.py"], "c.yaml", None),
    (["python", "-X", "importtime", "/v/bin/accelerate", "launch", "train.py", "--config_file", "x"], None, None),
    (["python", "tests/accelerate_launcher.py", "--config_file", "configs/cpu/fsdp_config.yaml", "--main_process_port",
      "2950", "./train.py", "--output_dir", "o"], "configs/cpu/fsdp_config.yaml", None),
])
def test_the_launchers_flags_are_read_from_its_command_line_as_accelerate_parses_them(parent, config_file, processes):
    args = launcher_arguments(parent, str(REPO / "train.py"), REPO)
    assert args is not None
    assert args.config_file == config_file and args.num_processes == processes


def test_a_command_line_without_the_script_is_no_launcher_of_it():
    assert launcher_arguments(["python", "-m", "accelerate.commands.launch", "other.py"], "train.py", REPO) is None


def test_the_yaml_is_found_relative_to_the_launchers_folder_and_only_under_accelerate(tmp_path, caplog):
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(edited("fsdp_config", fsdp_sharding_stratgy="NO_SHARD")))
    (tmp_path / "train.py").write_text("")
    parent = (["python", "/v/bin/accelerate", "launch", "--config_file", "mine.yaml", "train.py"], tmp_path)
    found = find_launcher_yaml(True, str(tmp_path / "train.py"), parent)
    assert found.path == tmp_path / "mine.yaml" and found.values["fsdp_config"]["fsdp_sharding_stratgy"] == "NO_SHARD"
    assert find_launcher_yaml(False, str(tmp_path / "train.py"), parent) is None  # python/torchrun: no YAML
    with caplog.at_level(logging.WARNING):
        assert find_launcher_yaml(True, str(tmp_path / "train.py"), (["python", "other.py"], tmp_path)) is None
    assert "the accelerate YAML of this run was not checked" in caplog.text  # said, not passed in silence


@pytest.mark.parametrize("yaml_precision, bf16, fp16, outcome", [
    ("no", False, False, "ok"),
    ("bf16", True, False, "ok"),
    ("bf16", False, False, "refused"),  # the CheckpointError at the first backward of issue 51
    ("fp16", False, False, "refused"),
    ("fp8", False, False, "refused"),
    ("no", True, False, "said"),  # the flags decide, as transformers does
    ("fp16", True, False, "said"),
    ("bf16", False, True, "said"),
])
def test_one_precision_story(yaml_precision, bf16, fp16, outcome, caplog):
    t = SimpleNamespace(bf16=bf16, fp16=fp16)
    with caplog.at_level(logging.WARNING):
        problems = precision_problems(t, LaunchEnv(mixed_precision=yaml_precision))
    if outcome == "refused":
        assert len(problems) == 1 and f"mixed_precision: {yaml_precision} in the accelerate config" in problems[0]
        assert "--bf16 False --fp16 False" in problems[0] and "mixed_precision: 'no'" in problems[0]
    else:
        assert problems == []
    assert ("is overridden" in caplog.text) == (outcome == "said")


@pytest.mark.parametrize("clipping, max_grad_norm, refused", [("0.5", 1.0, True), ("1.0", 1.0, False),
                                                              ("auto", 0.3, False), ("", 0.3, False)])
def test_deepspeeds_gradient_clipping_must_match_the_flag(clipping, max_grad_norm, refused):
    launch = LaunchEnv(use_deepspeed=True, gradient_clipping=clipping)
    problems = deepspeed_value_problems(SimpleNamespace(max_grad_norm=max_grad_norm), launch)
    assert bool(problems) == refused
    if refused:
        assert "gradient_clipping: 0.5" in problems[0] and "--max_grad_norm 1" in problems[0]


# family -> the class of its repeated decoder block (read from transformers' modeling files by hand)
FAMILY_BLOCK = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "gemma2": "Gemma2DecoderLayer",
                "mixtral": "MixtralDecoderLayer", "deepseek-v3": "DeepseekV3DecoderLayer", "gpt-neox": "GPTNeoXLayer"}


def _config_folder(root: Path, family: str) -> str:
    from sft_recipe.tiny.families import family_config

    folder = root / family
    family_config(family, vocab_size=64).save_pretrained(folder)  # the check reads the config alone (meta device)
    return str(folder)


@pytest.mark.parametrize("family", list(FAMILY_BLOCK))
def test_a_layer_class_to_wrap_must_be_one_the_models_structure_has(family, tmp_path):
    m = ModelArguments(model_name_or_path=_config_folder(tmp_path, family))
    t = SimpleNamespace(trust_remote_code=False)

    def problems(classes: str, policy: str = "TRANSFORMER_BASED_WRAP"):
        return wrap_class_problems(m, t, LaunchEnv(use_fsdp=True, fsdp_auto_wrap_policy=policy,
                                                   fsdp_transformer_layer_cls_to_wrap=classes))

    block = FAMILY_BLOCK[family]
    assert problems(block) == []
    wrong = "MistralDecoderLayer"  # copied from another family's config
    found = problems(f"{block},{wrong}")
    assert len(found) == 1 and found[0].startswith(f"fsdp_transformer_layer_cls_to_wrap: {wrong}:")
    assert f"Its repeated blocks are {block}" in found[0] and f"Fix: fsdp_transformer_layer_cls_to_wrap: {block}" \
        in found[0]
    assert problems(wrong, policy="SIZE_BASED_WRAP") == []  # the class is not read under a size policy


@pytest.mark.parametrize("policy", ["NO_WRAP", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP", ""])
@pytest.mark.parametrize("lora", [True, False])
def test_a_wrap_policy_a_lora_run_would_not_keep_is_refused_naming_it(policy, lora):
    # transformers' Trainer wraps a PEFT model with PEFT's policy (update_fsdp_plugin_peft); a full fine-tune keeps
    # the YAML's. "": the YAML does not say (nothing was edited).
    found = wrap_policy_problems(ModelArguments(use_peft_lora=lora),
                                 LaunchEnv(use_fsdp=True, fsdp_auto_wrap_policy=policy))
    if lora and policy in ("NO_WRAP", "SIZE_BASED_WRAP"):
        assert len(found) == 1 and found[0].startswith(f"fsdp_auto_wrap_policy: {policy} with --use_peft_lora True")
        assert "Fix: fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP" in found[0]
    else:
        assert found == []
    assert wrap_policy_problems(ModelArguments(use_peft_lora=lora), LaunchEnv(fsdp_auto_wrap_policy=policy)) == []
