"""The guide's two launch scripts run as written at tiny scale, and the recipe YAMLs say the same as the scripts.

Only what this machine forces is overridden, through the scripts' documented knobs (env MODEL/DATASET/OUTPUT_DIR/
ACCELERATE_CONFIG/NUM_PROCESSES, extra flags appended): a local model and dataset, a CPU accelerate config
(no GPU here), --use_flash_attn False (flash-attn needs CUDA), no upload (no Hub), and a few steps.
"""

from dataclasses import fields

import pytest

from sft_recipe.config.args import parse_args
from tests.helpers import REPO, launch_env, run_command, script_train_flags

TINY_SCALE = ["--use_flash_attn", "False", "--max_steps", "3", "--max_seq_len", "128",
              "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--logging_steps", "1"]


def _script_env(tiny, config, output_dir):
    env = launch_env()
    env.update(MODEL=str(tiny.model_dir), DATASET=str(tiny.jsonl_dir), OUTPUT_DIR=str(output_dir),
               ACCELERATE_CONFIG=config, NUM_PROCESSES="2")
    return env


def test_run_peft_fsdp_sh(tiny, tmp_path):
    out = tmp_path / "lora"
    # The guide's flags stay, bf16 included; offline, --defer_push_to_hub trains now and prints the upload command.
    # FSDP2: on CPU, FSDP1 + bf16 + non-reentrant checkpointing (this script's choice) fails, and is refused.
    result = run_command(["bash", "run_peft_fsdp.sh", *TINY_SCALE, "--defer_push_to_hub", "True"],
                         out, env=_script_env(tiny, "configs/cpu/fsdp2_config.yaml", out))
    assert result.returncode == 0, result.output[-5000:]
    facts = result.record
    how = facts["distribution"]
    assert (how["distributed_type"], how["fsdp_version"], how["num_processes"]) == ("FSDP", 2, 2)
    assert "adapter check OK" in result.output and facts["training"]["eval_losses"]  # --eval_strategy epoch ran
    assert (out / "adapter_model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    assert list(out.glob("checkpoint-*")), "--save_strategy epoch wrote a checkpoint"
    # The command uploads the checked adapter folder's files alone (the run record lists them): not the checkpoints,
    # the run record or the logs beside them in output_dir.
    files = facts["saves"]["final"]["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer_config.json",
            "generation_config.json"} <= set(files) and all((out / name).is_file() for name in files)
    assert not any(name.startswith("checkpoint-") or name.endswith(".json") and name.startswith("run_record")
                   for name in files)
    includes = "".join(f" --include {name}" for name in files)
    assert f"Push deferred. Upload later with: hf upload lora {out}{includes} --private" in result.output


def test_guide_command_offline_fails_early_naming_the_fix(tiny, tmp_path):
    out = tmp_path / "as-written"
    result = run_command(["bash", "run_peft_fsdp.sh", *TINY_SCALE, "--bf16", "False"], out,
                         env=_script_env(tiny, "configs/cpu/fsdp_config.yaml", out))
    assert result.returncode != 0
    assert "--push_to_hub: HF_HUB_OFFLINE is set" in result.output and "--defer_push_to_hub True" in result.output
    assert not out.exists(), "nothing was trained or written"


def test_run_peft_qlora_fsdp_sh(tiny, tmp_path):
    out = tmp_path / "qlora"
    # bf16 stays on as in the guide (storage dtype bfloat16 = model dtype); compute in fp32 for CPU speed.
    result = run_command(["bash", "run_peft_qlora_fsdp.sh", *TINY_SCALE, "--bnb_4bit_compute_dtype", "float32",
                          "--push_to_hub", "False"],
                         out, env=_script_env(tiny, "configs/cpu/fsdp_config.yaml", out))
    assert result.returncode == 0, result.output[-5000:]
    facts = result.record
    how = facts["distribution"]
    assert (how["distributed_type"], how["fsdp_version"], how["num_processes"]) == ("FSDP", 1, 2)
    assert facts["weights"]["frozen_changed"] is False and facts["weights"]["trainable_changed"] is True
    assert "adapter check OK" in result.output


def _script_flags(script: str, tmp_path) -> list[str]:
    """The train.py flags a script passes with its default MODEL/DATASET/OUTPUT_DIR (recorded by a fake launcher)."""
    return script_train_flags(script, tmp_path)[1]


@pytest.mark.parametrize("script,recipe", [("run_peft_fsdp.sh", "recipes/llama2_70b_lora.yaml"),
                                           ("run_peft_qlora_fsdp.sh", "recipes/llama2_70b_qlora.yaml")])
def test_recipe_yaml_matches_its_script(script, recipe, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # both ask for bf16
    from_script = parse_args(_script_flags(script, tmp_path))
    from_recipe = parse_args(["--config", str(REPO / recipe)])
    for a, b in zip(from_script, from_recipe):
        names = [f.name for f in fields(a) if f.name != "config"]
        assert {n: getattr(a, n) for n in names} == {n: getattr(b, n) for n in names}
