"""The whole-config check: every problem named with its fix, all at once, before weights load."""


import pytest

from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.preflight.validate import validate


def _problems(argv, monkeypatch=None, fsdp=False):
    if monkeypatch is not None and fsdp:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    m, d, r, t = parse_args(argv)
    with pytest.raises(ConfigError) as e:
        validate(m, d, r, t)
    return "\n".join(e.value.problems)


@pytest.fixture()
def good(tiny, tmp_path):
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(tmp_path / "out")]


def test_a_good_config_passes(good):
    validate(*parse_args(good))


FSDP1_CPU = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "true", "FSDP_VERSION": "1"}
FSDP2_CPU = {**FSDP1_CPU, "FSDP_VERSION": "2"}
QLORA = ["--use_peft_lora", "True", "--use_4bit_quantization", "True"]

# (flags, environment, what the message must say). Each is a real mistake; each message names setting, value, fix.
MISTAKES = {
    "unknown flag": (["--lora_alpah", "3"], {}, "Did you mean `lora_alpha`"),
    "abbreviated flag": (["--lora_al", "3"], {}, "unknown flag `--lora_al`"),
    "max_seq_len vs max_length": (["--max_seq_len", "512", "--max_length", "1024"], {}, "different values"),
    "bad choice": (["--chat_template_format", "llama3"], {}, "could not be parsed"),
    "bf16 and fp16 together": (["--bf16", "True", "--fp16", "True"], {"ACCELERATE_USE_CPU": "true"}, "fp16"),
    "bf16 without GPU": (["--bf16", "True"], {}, "--bf16 True: this machine has no GPU"),
    "unsloth": (["--use_unsloth", "True"], {}, "--use_unsloth True: the unsloth package is not installed"),
    "4-bit and 8-bit": (QLORA + ["--use_8bit_quantization", "True"], {}, "both True. Fix: keep one"),
    "quantized without LoRA": (["--use_4bit_quantization", "True"], {}, "add --use_peft_lora True"),
    "8-bit with FSDP": (["--use_peft_lora", "True", "--use_8bit_quantization", "True"], FSDP1_CPU,
                        "does not work with FSDP"),
    "uint8 storage under FSDP": (QLORA, FSDP1_CPU, "--bnb_4bit_quant_storage_dtype uint8 under FSDP"),
    "bf16 storage without bf16": (QLORA + ["--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16", "False"],
                                  FSDP1_CPU, "loads the model in bfloat16, but --bf16 is off"),
    "not a dtype": (QLORA + ["--bnb_4bit_compute_dtype", "float8"], {}, "'float8' is not a dtype"),
    "integer compute dtype": (QLORA + ["--bnb_4bit_compute_dtype", "uint8"], {}, "needs a float dtype"),
    "flash-attn missing": (["--use_flash_attn", "True"], {}, "--use_flash_attn True"),
    "lora_r zero": (["--use_peft_lora", "True", "--lora_r", "0"], {}, "--lora_r 0"),
    "lora_alpha negative": (["--use_peft_lora", "True", "--lora_alpha", "-4"], {}, "--lora_alpha -4"),
    "lora_dropout out of range": (["--use_peft_lora", "True", "--lora_dropout", "1.5"], {}, "--lora_dropout 1.5"),
    "target modules empty": (["--use_peft_lora", "True", "--lora_target_modules", " "], {}, "is empty"),
    "target modules not in model": (["--use_peft_lora", "True", "--lora_target_modules", "q_proj,c_attn"], {},
                                    "['c_attn'] match no linear layer of this model. Fix: choose from ['down_proj'"),
    "float32 4-bit storage under FSDP1": (QLORA + ["--bnb_4bit_quant_storage_dtype", "float32"], FSDP1_CPU,
                                          "--bnb_4bit_quant_storage_dtype float32 under FSDP1"),
    "DoRA with 8-bit": (["--use_peft_lora", "True", "--use_8bit_quantization", "True", "--use_dora", "True"], {},
                        "--use_dora True with --use_8bit_quantization True"),
    "QDoRA under FSDP2": (QLORA + ["--use_dora", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16",
                                   "True"], FSDP2_CPU, "(QDoRA) under FSDP2"),
    "DoRA without LoRA": (["--use_dora", "True"], {}, "--use_dora configures the LoRA adapter"),
    "trainable tokens under FSDP1": (["--use_peft_lora", "True", "--train_new_tokens", "True"], FSDP1_CPU,
                                     "--train_new_tokens True under FSDP1 with fsdp_use_orig_params: false"),
    "trainable tokens beside a bf16 base under FSDP1": (
        ["--use_peft_lora", "True", "--train_new_tokens", "True", "--torch_dtype", "bfloat16"],
        {**FSDP1_CPU, "FSDP_USE_ORIG_PARAMS": "true"}, "--train_new_tokens True under FSDP1 with a bfloat16 base"),
    "modules_to_save under FSDP1": (["--use_peft_lora", "True", "--lora_modules_to_save", "embed_tokens"], FSDP1_CPU,
                                    "--lora_modules_to_save under FSDP1"),
    "modules_to_save not in model": (["--use_peft_lora", "True", "--lora_modules_to_save", "wte"], {},
                                     "['wte'] match no module of this model. Fix: usual choices are ['embed_tokens'"),
    "8-bit optimizer under FSDP2": (["--use_peft_lora", "True", "--optim", "paged_adamw_8bit"], FSDP2_CPU,
                                    "--optim paged_adamw_8bit under FSDP2"),
    "8-bit optimizer under FSDP1": (["--use_peft_lora", "True", "--optim", "adamw_bnb_8bit"], FSDP1_CPU,
                                    "--optim adamw_bnb_8bit under FSDP1"),
    "CPU offload on a CPU run": ([], {**FSDP2_CPU, "FSDP_OFFLOAD_PARAMS": "true"},
                                 "fsdp_offload_params: true on a CPU run"),
    "push offline": (["--push_to_hub", "True"], {}, "--push_to_hub: HF_HUB_OFFLINE is set"),
    "token on the command line": (["--hub_token", "hf_secret"], {}, "--hub_token: a token on the command line"),
    "max_seq_len zero": (["--max_seq_len", "0"], {}, "must be a positive number of tokens"),
    "batch size zero": (["--per_device_train_batch_size", "0"], {}, "--per_device_train_batch_size 0"),
    "accumulation zero": (["--gradient_accumulation_steps", "0"], {}, "--gradient_accumulation_steps 0"),
    "learning rate zero": (["--learning_rate", "0"], {}, "--learning_rate 0.0: must be positive"),
    "nothing to train": (["--num_train_epochs", "0"], {}, "nothing to train"),
    "streaming asked": (["--dataset_streaming", "True"], {}, "--dataset_streaming True: every row is checked"),
    "eval without test split": (["--eval_strategy", "epoch", "--splits", "train"], {}, "needs a test split"),
    "dataset missing": (["--dataset_name", "./no/such/data"], {}, "no such file or folder"),
    "split missing": (["--splits", "train,test_extra"], {}, "no split 'test_extra'"),
    "split name unknown": (["--splits", "train,dev"], {}, "split 'dev' is neither"),
    "model missing": (["--model_name_or_path", "./no/such/model"], {}, "./no/such/model: no such folder"),
    "resume from nothing": (["--resume_from_checkpoint", "latest"], {}, "no complete checkpoint"),
    "resume path missing": (["--resume_from_checkpoint", "/no/ckpt"], {}, "no such checkpoint folder"),
    "efficient loading without sync": ([], {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                                            "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                                            "FSDP_SYNC_MODULE_STATES": "false"}, "needs fsdp_sync_module_states"),
    "FSDP1 sync on CPU": ([], {**FSDP1_CPU, "FSDP_SYNC_MODULE_STATES": "true"}, "does not work for FSDP1 on CPU"),
    "full-state-dict checkpoints": (["--save_strategy", "steps"],
                                    {**FSDP2_CPU, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"},
                                    "gathers every weight onto rank 0 at each checkpoint"),
    "FSDP1 CPU bf16 non-reentrant": (["--bf16", "True", "--gradient_checkpointing", "True", "--use_reentrant",
                                      "False"], FSDP1_CPU, "Fix: --use_reentrant True"),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_mistake_is_named_with_its_fix(good, name, monkeypatch):
    flags, env, expected = MISTAKES[name]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU", "FSDP_VERSION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as e:
        validate(*parse_args(good + flags))
    problem = next((p for p in e.value.problems if expected in p), None)
    assert problem is not None, e.value.problems
    assert "fix" in problem.lower(), f"the message must name the fix: {problem}"


def test_new_token_rows_under_fsdp1_keeping_original_parameters_pass(good, monkeypatch):
    """With fsdp_use_orig_params: true FSDP1 keeps each parameter's requires_grad in a unit, and the rows train as in
    one process (tests/e2e/test_adapter_variants.py): nothing is refused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in {**FSDP1_CPU, "FSDP_USE_ORIG_PARAMS": "true"}.items():
        monkeypatch.setenv(key, value)
    validate(*parse_args(good + ["--use_peft_lora", "True", "--train_new_tokens", "True"]))


def test_more_processes_than_gpus(good, monkeypatch):
    import sft_recipe.preflight.validate as v

    monkeypatch.setattr(v, "torch_cuda_count", lambda: 2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="num_processes per machine is 8 but only 2 GPUs are visible"):
        validate(*parse_args(good))


def test_push_checks_the_token_can_write_before_training(good, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **k: {"name": "alice",
                                                                "auth": {"accessToken": {"role": "read"}}})
    with pytest.raises(ConfigError, match="the token of alice is read-only, so pushing to alice/out would fail"):
        validate(*parse_args(good + ["--push_to_hub", "True"]))

    def forbidden(self, repo_id, **kwargs):
        from huggingface_hub.utils import HfHubHTTPError
        raise HfHubHTTPError("403")
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **k: {"name": "alice",
                                                                "auth": {"accessToken": {"role": "write"}}})
    monkeypatch.setattr(HfApi, "auth_check", forbidden)
    with pytest.raises(ConfigError, match="no write access to org/model"):
        validate(*parse_args(good + ["--push_to_hub", "True", "--hub_model_id", "org/model"]))
    monkeypatch.setattr(HfApi, "auth_check", lambda self, repo_id, **kwargs: None)
    validate(*parse_args(good + ["--push_to_hub", "True", "--hub_model_id", "org/model"]))


def test_repositories_are_private_unless_asked():
    assert parse_args(["--output_dir", "o"])[3].hub_private_repo is True
    assert parse_args(["--output_dir", "o", "--hub_private_repo", "False"])[3].hub_private_repo is False


def test_fsdp2_on_cpu_handles_bf16_with_non_reentrant_checkpointing(good, monkeypatch):
    for key, value in {**FSDP1_CPU, "FSDP_VERSION": "2"}.items():
        monkeypatch.setenv(key, value)
    validate(*parse_args(good + ["--bf16", "True", "--gradient_checkpointing", "True", "--use_reentrant", "False"]))


def test_use_orig_params_with_qlora_is_accepted_without_a_memory_warning(good, monkeypatch, caplog):
    # It used to warn of gradient buffers for the frozen 4-bit weights; measured (bench/use_orig_params.py): +0 MiB
    # per rank, since PEFT's wrap policy keeps every decoder unit wholly frozen.
    for key, value in {**FSDP1_CPU, "FSDP_USE_ORIG_PARAMS": "true"}.items():
        monkeypatch.setenv(key, value)
    validate(*parse_args(good + QLORA + ["--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16", "True",
                                        "--use_reentrant", "True"]))
    assert "use_orig_params" not in caplog.text


def test_push_later_is_accepted_offline(good, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    validate(*parse_args(good + ["--push_to_hub", "True", "--defer_push_to_hub", "True"]))


def test_all_problems_are_reported_together(good, monkeypatch):
    text = _problems(good + ["--use_unsloth", "True", "--lora_r", "0", "--use_peft_lora", "True",
                             "--splits", "train,dev", "--use_flash_attn", "True"])
    assert text.count("\n") >= 3


