"""The whole-config check: every problem named with its fix, all at once, before weights load."""

import subprocess
import sys

import pytest

from sft_recipe.args import ConfigError, parse_args
from sft_recipe.validate import validate
from tests.conftest import REPO, launch_env


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


@pytest.mark.parametrize("flags,expected", [
    (["--use_unsloth", "True"], "--use_unsloth True is not supported"),
    (["--use_peft_lora", "True", "--use_4bit_quantization", "True", "--use_8bit_quantization", "True"],
     "both True: pick one"),
    (["--use_4bit_quantization", "True"], "add --use_peft_lora True"),
    (["--use_flash_attn", "True"], "--use_flash_attn True"),
    (["--use_peft_lora", "True", "--lora_r", "0"], "--lora_r 0"),
    (["--use_peft_lora", "True", "--lora_dropout", "1.5"], "--lora_dropout 1.5"),
    (["--bnb_4bit_compute_dtype", "float8"], "--bnb_4bit_compute_dtype 'float8' is not a dtype"),
    (["--push_to_hub", "True"], "--push_to_hub: HF_HUB_OFFLINE is set"),
    (["--max_seq_len", "0"], "must be a positive number of tokens"),
    (["--dataset_name", "./no/such/data"], "no such file or folder"),
    (["--model_name_or_path", "./no/such/model"], "--model_name_or_path ./no/such/model: no such folder"),
    (["--splits", "train,dev"], "split 'dev' is neither"),
])
def test_each_mistake_is_named_with_its_fix(good, flags, expected, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert expected in _problems(good + flags)


def test_fsdp_only_mistakes(good, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    text = _problems(good + ["--use_peft_lora", "True", "--use_8bit_quantization", "True"], monkeypatch, fsdp=True)
    assert "does not work with FSDP" in text
    text = _problems(good + ["--use_peft_lora", "True", "--use_4bit_quantization", "True"], monkeypatch, fsdp=True)
    assert "--bnb_4bit_quant_storage_dtype uint8 under FSDP" in text
    text = _problems(good + ["--use_peft_lora", "True", "--use_4bit_quantization", "True",
                             "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16", "False"], monkeypatch, fsdp=True)
    assert "loads the model in bfloat16, but --bf16 is off" in text


def test_fsdp1_cpu_bf16_nonreentrant_checkpointing_is_refused(good, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    flags = ["--bf16", "True", "--gradient_checkpointing", "True", "--use_reentrant", "False"]
    assert "Fix: --use_reentrant True" in _problems(good + flags, monkeypatch, fsdp=True)
    monkeypatch.setenv("FSDP_VERSION", "2")  # FSDP2 handles it
    validate(*parse_args(good + flags))


def test_push_later_is_accepted_offline(good, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    validate(*parse_args(good + ["--push_to_hub", "True", "--defer_push_to_hub", "True"]))


def test_all_problems_are_reported_together(good, monkeypatch):
    text = _problems(good + ["--use_unsloth", "True", "--lora_r", "0", "--use_peft_lora", "True",
                             "--splits", "train,dev", "--use_flash_attn", "True"])
    assert text.count("\n") >= 3


def test_train_py_exits_2_with_the_list_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "--model_name_or_path", "./no/model", "--dataset_name", "./no/data",
         "--lora_alpah", "3", "--output_dir", str(tmp_path / "o")],
        cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown flag `--lora_alpah`" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    proc = subprocess.run(
        [sys.executable, "train.py", "--model_name_or_path", "./no/model", "--dataset_name", "./no/data",
         "--output_dir", str(tmp_path / "o")],
        cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "2 configuration problem(s)" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "o").exists()


def test_fsdp_asked_without_gpu_or_cpu_switch_is_refused(tmp_path, tiny):
    env = launch_env(cpu_switch=False)
    env["ACCELERATE_USE_FSDP"] = "true"
    proc = subprocess.run(
        [sys.executable, "train.py", "--model_name_or_path", str(tiny.model_dir), "--dataset_name",
         str(tiny.jsonl_dir), "--output_dir", str(tmp_path / "o")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "ACCELERATE_USE_CPU=true" in proc.stderr
