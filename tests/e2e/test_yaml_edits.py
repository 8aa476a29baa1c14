"""The edits users make to the accelerate YAML, through the real launcher (issue 51), on a model other than the
Llama demo (the tied Qwen2): each edit that should train trains as written, with the one-process run's losses; each
mistake ends in exit 2 on every rank before any weight loads, with a line naming the key or value and its fix.

The edits that keep the numbers are merged into one edited YAML per engine (each launch is ~6-9 s): whether each
reached the engine is read back from the run record's `distribution.engine_settings` (read from the wrapped engine
itself, not from the YAML), and the losses of the 4 steps must equal the one-process run's (batch 4 = 2 ranks x 2;
fp32, dropout 0: only the order of reductions differs, tests/e2e/test_parity.py). The mistakes of each engine are
merged the same way into one YAML: every one must be listed at once. Unit tests of each check:
tests/unit/test_launcher_yaml.py."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import RELATIVE_TOLERANCE, REPO, launch_env, launch_train

FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--chat_template_format", "chatml", "--max_seq_len", "64",
         "--per_device_train_batch_size", "2", "--logging_steps", "1", "--learning_rate", "3e-3", "--packing", "True",
         "--report_to", "none", "--eval_strategy", "no", "--seed", "7", "--bf16", "False", "--max_steps", "4",
         "--save_strategy", "no"]
BASE = {"fsdp1": "cpu/fsdp_config.yaml", "fsdp2": "cpu/fsdp2_config.yaml", "zero3": "cpu/deepspeed_config.yaml"}

# cell -> (engine's CPU twin, section, the edits, what the engine must then run with)
TRAINS = {
    "fsdp1-edited": ("fsdp1", "fsdp_config", {
        "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_backward_prefetch": "BACKWARD_POST",
        "fsdp_forward_prefetch": True, "fsdp_use_orig_params": True, "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer"},
        {"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True,
         "use_orig_params": True, "state_dict_type": "FULL_STATE_DICT"}),
    "fsdp2-edited": ("fsdp2", "fsdp_config", {
        "fsdp_reshard_after_forward": False, "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer"},
        {"reshard_after_forward": False, "state_dict_type": "FULL_STATE_DICT"}),
    "zero1": ("zero3", "deepspeed_config", {"zero_stage": 1}, {"zero_stage": 1}),
    "zero2": ("zero3", "deepspeed_config", {"zero_stage": 2, "gradient_clipping": 1.0}, {"zero_stage": 2}),
    "zero3-no-init": ("zero3", "deepspeed_config", {"zero3_init_flag": False}, {"zero_stage": 3}),
}

# cell -> (engine, section edits, top-level edits, the lines every rank must refuse with)
REFUSED = {
    "fsdp1-mistakes": ("fsdp1", {"fsdp_sharding_stratgy": "NO_SHARD", "fsdp_transformer_layer_cls_to_wrap":
                                 "LlamaDecoderLayer"}, {"mixed_precision": "bf16"}, [
        "`fsdp_config.fsdp_sharding_stratgy` is not a key accelerate knows",
        "Did you mean `fsdp_sharding_strategy`?",
        "fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer: Qwen2ForCausalLM has no module of that class",
        "Fix: fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer",
        "mixed_precision: bf16 in the accelerate config", "but the flags ask for fp32"]),
    # NO_WRAP: a LoRA run is wrapped by PEFT's policy whatever the YAML says (measured: a FSDP1 LoRA run launched
    # with NO_WRAP, SIZE_BASED_WRAP and TRANSFORMER_BASED_WRAP wrapped the same 31 units)
    "fsdp2-mistakes": ("fsdp2", {"reshard_after_foward": False, "fsdp_auto_wrap_policy": "NO_WRAP"}, {}, [
        "`fsdp_config.reshard_after_foward` is not a key accelerate knows",
        "Did you mean `fsdp_reshard_after_forward`?",
        "fsdp_auto_wrap_policy: NO_WRAP with --use_peft_lora True", "Fix: fsdp_auto_wrap_policy: "
        "TRANSFORMER_BASED_WRAP"]),
    "zero3-mistakes": ("zero3", {"zero_stag": 2, "gradient_clipping": 0.5}, {}, [
        "`deepspeed_config.zero_stag` is not a key accelerate knows", "Did you mean `zero_stage`?",
        "gradient_clipping: 0.5 in the DeepSpeed config but --max_grad_norm 1"]),
}


def _yaml(tmp_path, cell: str, engine: str, section: dict, top: dict | None = None):
    values = yaml.safe_load((REPO / "configs" / BASE[engine]).read_text())
    values["deepspeed_config" if engine == "zero3" else "fsdp_config"].update(section)
    values.update(top or {})
    path = tmp_path / f"{cell}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _launch(config, out, family_model, tiny, engine: str, extra=()):
    flags = ["--model_name_or_path", str(family_model("qwen2")), "--dataset_name", str(tiny.jsonl_dir), *FLAGS,
             *(["--ddp_backend", "gloo"] if engine == "zero3" else []), *extra]
    return launch_train(str(config), out, flags, env=launch_env(cpu_switch=engine != "zero3"))


@pytest.fixture(scope="module")
def runs(family_model, tiny, tmp_path_factory):
    yamls = tmp_path_factory.mktemp("yamls")
    results = {"single": _launch(REPO / "configs/cpu/single.yaml", tmp_path_factory.mktemp("single"), family_model,
                                 tiny, "single", ["--per_device_train_batch_size", "4"])}
    for cell, (engine, _, edits, _) in TRAINS.items():
        results[cell] = _launch(_yaml(yamls, cell, engine, edits), tmp_path_factory.mktemp(cell), family_model, tiny,
                                engine)
    for cell, (engine, edits, top, _) in REFUSED.items():
        out = tmp_path_factory.mktemp(cell) / "out"
        results[cell] = _launch(_yaml(yamls, cell, engine, edits, top), out, family_model, tiny, engine)
    return results


@pytest.mark.parametrize("cell", list(TRAINS))
def test_an_edit_that_should_train_trains_as_written_with_the_same_numbers(runs, cell):
    reference, result = runs["single"], runs[cell]
    assert reference.returncode == 0, reference.output[-3000:]
    assert result.returncode == 0, result.output[-3000:]
    settings = result.record["distribution"]["engine_settings"]
    assert {k: settings.get(k) for k in TRAINS[cell][3]} == TRAINS[cell][3]  # the edit reached the engine
    losses, expected = result.record["training"]["losses"], reference.record["training"]["losses"]
    assert len(losses) == len(expected) == 4
    for a, b in zip(losses, expected):
        assert abs(a - b) <= RELATIVE_TOLERANCE * abs(b), (cell, losses, expected)
    assert "adapter check OK" in result.output and (result.output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("cell", list(REFUSED))
def test_a_mistake_is_refused_on_every_rank_before_any_weight_loads(runs, cell):
    result = runs[cell]
    assert result.returncode != 0
    for line in REFUSED[cell][3]:
        assert result.output.count(line) == 1, (line, result.output[-4000:])  # listed once, by the main process
    assert result.output.count("exitcode  : 2") + result.output.count("exitcode: 2") >= 1, result.output[-2000:]
    assert "[rank0]: Traceback" not in result.output and "[rank1]: Traceback" not in result.output
    assert not result.output_dir.exists()  # nothing loaded, nothing written


def test_a_misspelt_launcher_flag_or_top_level_key_is_refused_by_accelerate_before_any_rank_starts(tmp_path):
    # accelerate's own refusals (its argparse; its ClusterConfig's "unknown keys"): train.py never starts, so the
    # recipe adds nothing there but the did-you-mean of `python -m sft_recipe.config.launcher_yaml` (unit tests).
    result = launch_train("cpu/fsdp_config.yaml", tmp_path / "out", ["--model_name_or_path", "x"],
                          launcher_args=("--fsdp_sharding_stratgy", "NO_SHARD"))
    assert result.returncode == 2 and "unrecognized arguments: --fsdp_sharding_stratgy" in result.output
    top = _yaml(tmp_path, "top", "fsdp1", {}, {"mixed_precission": "bf16"})
    result = launch_train(str(top), tmp_path / "out", ["--model_name_or_path", "x"])
    assert result.returncode == 1 and "had unknown keys (['mixed_precission'])" in result.output
    assert "[rank0]" not in result.output and not (tmp_path / "out").exists()
