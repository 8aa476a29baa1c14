"""Argument parsing: upstream flags, the --max_seq_len alias, recipe YAML precedence, loud unknown keys."""

import pytest

from sft_recipe.config.args import ConfigError, parse_args

GUIDE_FLAGS = [
    "--seed", "100", "--model_name_or_path", "m", "--dataset_name", "d", "--chat_template_format", "chatml",
    "--add_special_tokens", "False", "--append_concat_token", "False", "--splits", "train,test",
    "--max_seq_len", "2048", "--num_train_epochs", "1", "--logging_steps", "5", "--log_level", "info",
    "--logging_strategy", "steps", "--eval_strategy", "epoch", "--save_strategy", "epoch", "--push_to_hub",
    "--hub_private_repo", "True", "--hub_strategy", "every_save", "--packing", "True", "--learning_rate", "1e-4",
    "--lr_scheduler_type", "cosine", "--weight_decay", "1e-4", "--warmup_steps", "0", "--max_grad_norm", "1.0",
    "--output_dir", "out", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
    "--gradient_accumulation_steps", "4", "--gradient_checkpointing", "True", "--use_reentrant", "False",
    "--dataset_text_field", "content", "--use_flash_attn", "True", "--use_peft_lora", "True", "--lora_r", "8",
    "--lora_alpha", "16", "--lora_dropout", "0.1", "--lora_target_modules", "all-linear",
    "--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_compute_dtype", "bfloat16",
    "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16", "True",
]


def test_guide_flags_parse_with_their_meaning(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # lets --bf16 True parse on this GPU-less machine
    m, d, r, t = parse_args(GUIDE_FLAGS)
    assert t.max_length == 2048  # the guide's --max_seq_len is TRL's max_length
    assert t.push_to_hub and t.hub_private_repo and t.hub_strategy == "every_save"
    assert t.dataset_text_field == "content" and t.packing and t.bf16 and t.seed == 100
    assert (m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules) == (8, 16, 0.1, "all-linear")
    assert m.use_4bit_quantization and m.use_nested_quant and m.bnb_4bit_quant_storage_dtype == "bfloat16"
    assert m.chat_template_format == "chatml" and d.splits == "train,test" and not d.append_concat_token
    assert not t.trust_remote_code  # never on unless asked


def test_bf16_defaults_off_without_a_bf16_gpu():
    t = parse_args(["--output_dir", "o"])[3]
    assert t.bf16 is False


def test_explicit_bf16_without_gpu_or_cpu_switch_is_refused(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with pytest.raises(ConfigError, match="--bf16 True: this machine has no GPU"):
        parse_args(["--output_dir", "o", "--bf16", "True"])


def test_unknown_and_misspelled_flags_are_all_reported_with_suggestions():
    with pytest.raises(ConfigError) as e:
        parse_args(["--output_dir", "o", "--lora_alpah", "3", "--learnig_rate", "1"])
    assert len(e.value.problems) == 2
    assert "`--lora_alpah`" in str(e.value) and "Did you mean `lora_alpha`" in str(e.value)
    assert "Did you mean `learning_rate`" in str(e.value)


def test_prefix_of_a_flag_is_not_silently_accepted():
    with pytest.raises(ConfigError, match="unknown flag `--lora_al`"):
        parse_args(["--output_dir", "o", "--lora_al", "3"])


def test_max_seq_len_and_max_length_disagreeing_is_an_error():
    with pytest.raises(ConfigError, match="different values"):
        parse_args(["--output_dir", "o", "--max_seq_len", "512", "--max_length", "1024"])
    assert parse_args(["--output_dir", "o", "--max_seq_len", "512", "--max_length", "512"])[3].max_length == 512
    assert parse_args(["--output_dir", "o", "--max_seq_len=300"])[3].max_length == 300


def test_recipe_yaml_overrides_defaults_and_cli_overrides_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lora_r: 4\nlora_alpha: 8\nmax_seq_len: 333\nlearning_rate: 0.002\n")
    m, _, r, t = parse_args(["--config", str(recipe), "--output_dir", "o", "--lora_alpha", "32"])
    assert m.lora_r == 4 and m.lora_alpha == 32 and t.max_length == 333 and t.learning_rate == 0.002
    assert r.config == str(recipe)


def test_recipe_yaml_unknown_keys_are_named(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lora_rank: 4\nlearning_rat: 1\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(recipe), "--output_dir", "o"])
    text = str(e.value)
    assert "unknown key `lora_rank`" in text and "unknown key `learning_rat`" in text
    assert "Did you mean `learning_rate`" in text


def test_recipe_yaml_missing_or_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "nope.yaml"), "--output_dir", "o"])
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        parse_args(["--config", str(bad), "--output_dir", "o"])


def test_bad_choice_is_a_config_error():
    with pytest.raises(ConfigError):
        parse_args(["--output_dir", "o", "--chat_template_format", "llama3"])


def test_a_repeated_flag_takes_the_last_value_as_argparse_does():
    # the launch scripts rely on it: extra flags appended after the guide's override them
    assert parse_args(["--output_dir", "o", "--max_seq_len", "2048", "--max_seq_len", "128"])[3].max_length == 128


def test_modules_to_save_is_read_in_one_place():
    """--lora_modules_to_save as names: the property every room asks (LoRA config, checks, disk estimate, resume)."""
    from sft_recipe.config.args import ModelArguments

    names = ModelArguments(lora_modules_to_save=" embed_tokens , lm_head,").modules_to_save
    assert names == ["embed_tokens", "lm_head"]
    assert ModelArguments().modules_to_save == []
