"""--adapter_name_or_path (sft_recipe/train/start_adapter.py): an existing LoRA adapter trained further. Its shape
decides the LoraConfig, its weights are loaded before any engine wraps the model, and what cannot work is refused
before any weight loads: a LoRA flag that disagrees with it, another base, missing weights, another kind of adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import GUIDE_LORA
from tests.helpers import run_train_in_process as run_train


@pytest.fixture()
def adapter(tiny, tmp_path):
    """A LoRA adapter of the tiny model (r 8, alpha 32, q_proj and v_proj), its lora_B made non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.01)
    folder = tmp_path / "adapter"
    peft.save_pretrained(str(folder))
    return folder


def _argv(tiny, tmp_path, adapter, *extra):
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), "--output_dir",
            str(tmp_path / "out"), *GUIDE_LORA, "--adapter_name_or_path", str(adapter), *extra]


def test_the_adapters_shape_is_what_trains(tiny, tmp_path, adapter, monkeypatch, capsys):
    from sft_recipe.config.args import ModelArguments
    from sft_recipe.train.model import lora_config

    code, err = run_train([*_argv(tiny, tmp_path, adapter)], monkeypatch, capsys)
    assert code == "weights", err  # the guide's --lora_r 64 is its default here: the adapter's 8 is taken
    config = lora_config(ModelArguments(model_name_or_path=str(tiny.model_dir), use_peft_lora=True,
                                        adapter_name_or_path=str(adapter)))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (8, 32, ["q_proj", "v_proj"])


@pytest.mark.parametrize("extra,expected", [
    (["--lora_r", "16"], "--lora_r 16, but the adapter at {adapter} has 8: its shape is what is trained further"),
    (["--lora_alpha", "8"], "--lora_alpha 8, but the adapter at {adapter} has 32"),
    (["--lora_target_modules", "q_proj,k_proj"], "--lora_target_modules q_proj,k_proj, but the adapter at {adapter} "
                                                 "adapts ['q_proj', 'v_proj']"),
    (["--use_peft_lora", "False"], "with --use_peft_lora False: the adapter is what would be trained"),
])
def test_a_flag_that_disagrees_is_refused_before_any_weight(extra, expected, tiny, tmp_path, adapter, monkeypatch,
                                                            capsys):
    # After GUIDE_LORA's flags (--lora_r 64, --lora_alpha 16: the defaults, so taken as not given): the last wins.
    code, err = run_train([*_argv(tiny, tmp_path, adapter), *extra], monkeypatch, capsys)
    assert code == 2 and expected.format(adapter=adapter) in err, err


def test_another_base_missing_weights_and_no_adapter_are_refused(tiny, tmp_path, adapter, monkeypatch, capsys):
    config = json.loads((adapter / "adapter_config.json").read_text())
    other = tmp_path / "other-base"
    shutil.copytree(adapter, other)
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/another"}))
    code, err = run_train(_argv(tiny, tmp_path, other), monkeypatch, capsys)
    assert code == 2 and "was trained on org/another, but --model_name_or_path is" in err, err
    (other / "adapter_model.safetensors").unlink()
    (other / "adapter_config.json").write_text(json.dumps(config))
    code, err = run_train(_argv(tiny, tmp_path, other), monkeypatch, capsys)
    assert code == 2 and "no adapter_model.safetensors: the weights to continue from are missing" in err, err
    code, err = run_train(_argv(tiny, tmp_path, tmp_path / "nowhere"), monkeypatch, capsys)
    assert code == 2 and "no PEFT adapter could be read there" in err, err


def test_the_weights_are_the_adapters(tiny, adapter):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.config.args import ModelArguments
    from sft_recipe.train.start_adapter import load_start_adapter, start_lora_config

    config = start_lora_config(ModelArguments(adapter_name_or_path=str(adapter)), LoraConfig(r=64))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)), config)
    assert load_start_adapter(model, str(adapter)) == 8  # 2 layers x (q, v) x (A, B)
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    for key, tensor in saved.items():
        (live,) = [v for k, v in state.items() if k.replace(".default", "") == key]
        assert torch.equal(live, tensor), key
