"""The adapter check catches every way a saved adapter can be silently broken."""

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from sft_recipe.artifacts.adapter import ADAPTER_WEIGHTS, check_adapter


@pytest.fixture()
def trained_adapter(tiny, tmp_path):
    """A LoRA adapter on the tiny model whose lora_B tensors are non-zero, as after training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.save_pretrained(str(tmp_path / "adapter"))
    return tmp_path / "adapter"


def _rewrite(adapter_dir, change):
    path = adapter_dir / ADAPTER_WEIGHTS
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_complete_adapter_passes(trained_adapter):
    report = check_adapter(str(trained_adapter))
    assert report.ok, report.summary()
    assert report.lora_tensors == report.tensors == 2 * 7 * 2  # A and B, 7 linear layers, 2 blocks


def test_empty_adapter_fails(trained_adapter):
    save_file({}, str(trained_adapter / ADAPTER_WEIGHTS))  # what the peft 0.21 FSDP1 bug writes
    report = check_adapter(str(trained_adapter))
    assert not report.ok and "28 of 28 expected tensors are missing" in report.summary()


def test_missing_tensor_fails(trained_adapter):
    _rewrite(trained_adapter, lambda t: t.pop(sorted(t)[0]))
    assert "1 of 28 expected tensors are missing" in check_adapter(str(trained_adapter)).summary()


def test_wrong_shape_fails(trained_adapter):
    def shrink(t):
        key = next(k for k in t if "lora_A" in k)
        t[key] = t[key][:2].contiguous()
    _rewrite(trained_adapter, shrink)
    summary = check_adapter(str(trained_adapter)).summary()
    assert "shape (2, " in summary and "expected (4, " in summary


def test_untrained_lora_b_fails_only_when_training_happened(trained_adapter):
    _rewrite(trained_adapter, lambda t: t.update({k: torch.zeros_like(v) for k, v in t.items() if "lora_B" in k}))
    assert "14 lora_B tensors are all zeros" in check_adapter(str(trained_adapter)).summary()
    assert check_adapter(str(trained_adapter), trained=False).ok


def test_nan_fails(trained_adapter):
    def poison(t):
        key = sorted(t)[0]
        t[key] = torch.full_like(t[key], float("nan"))
    _rewrite(trained_adapter, poison)
    assert "holds NaN or inf" in check_adapter(str(trained_adapter)).summary()


def test_missing_files_fail(tmp_path):
    report = check_adapter(str(tmp_path))
    assert "adapter_config.json is missing" in report.summary()
    assert "adapter_model.safetensors is missing" in report.summary()


class _FakeAccelerator:
    def unwrap_model(self, model):
        return model


class _FakeTrainer:
    """What `_write_and_check` uses of a Trainer: the accelerator, the model, the tokenizer."""

    def __init__(self, model, tokenizer):
        self.accelerator, self.model, self.processing_class = _FakeAccelerator(), model, tokenizer


def test_a_failed_check_never_replaces_the_previous_adapter(tiny, trained_adapter, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_recipe.artifacts.adapter import AdapterCheckError, _write_and_check

    out = tmp_path / "out"
    out.mkdir()
    for f in trained_adapter.iterdir():  # a previous run's good adapter
        (out / f.name).write_bytes(f.read_bytes())
    before = (out / ADAPTER_WEIGHTS).read_bytes()
    # A fresh LoRA model: lora_B is all zeros, as if training never reached it.
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer = _FakeTrainer(model, AutoTokenizer.from_pretrained(str(tiny.model_dir)))
    with pytest.raises(AdapterCheckError, match="lora_B tensors are all zeros"):
        _write_and_check(trainer, model.state_dict(), str(out), verify=True, trust_remote_code=False)
    assert (out / ADAPTER_WEIGHTS).read_bytes() == before
    assert (out / "_adapter-FAILED-CHECK" / ADAPTER_WEIGHTS).is_file()
    assert not list(out.glob("_adapter-writing-*"))


def test_a_passing_check_moves_the_files_into_place(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_recipe.artifacts.adapter import _write_and_check

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    out = tmp_path / "out"
    _write_and_check(_FakeTrainer(model, AutoTokenizer.from_pretrained(str(tiny.model_dir))), model.state_dict(),
                     str(out), verify=True, trust_remote_code=False)
    assert check_adapter(str(out)).ok and (out / "tokenizer_config.json").is_file()
    assert not list(out.glob("_adapter-writing-*"))


@pytest.mark.parametrize("resized", [False, True])
def test_an_embedding_trained_in_full_passes_with_and_without_a_resized_vocabulary(tiny, tmp_path, resized):
    """modules_to_save copies of embed_tokens/lm_head hold every row, but PEFT saves the embedding layers beside
    them only after a resize: the expectation must not ask for them otherwise (the checkpoint check failed
    "4 of 34 expected tensors are missing" on every one-process run with --lora_modules_to_save and no chat tokens)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    if resized:
        base.resize_token_embeddings(base.get_input_embeddings().weight.shape[0] + 3, mean_resizing=False)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", modules_to_save=["embed_tokens",
                                                                                              "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.save_pretrained(str(tmp_path / "adapter"))
    saved = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert "base_model.model.model.embed_tokens.weight" in saved  # the trained copy, under the module's name
    assert any("original_module" in k for k in saved) == resized  # the embedding layers saved beside it
    report = check_adapter(str(tmp_path / "adapter"))
    assert report.ok, report.summary()


def test_a_failed_check_at_the_final_save_exits_5_with_the_message_and_the_files_kept(tiny, tmp_path, monkeypatch,
                                                                                       capsys, keep_signal_handlers):
    """A real run whose final adapter fails its check (the check's verdict forced: every cause the recipe knows is
    refused before training now) ends with exit 5 and the report, never a traceback."""
    import train
    from sft_recipe.artifacts import adapter as adapter_module
    from sft_recipe.artifacts.adapter import ADAPTER_CHECK_EXIT_CODE, AdapterReport
    from sft_recipe.config.launch_env import LaunchEnv

    real = adapter_module.check_adapter

    def failing(folder, **kwargs):
        report = real(folder, **kwargs)
        return AdapterReport(report.adapter_dir, report.tensors, report.lora_tensors,
                             ["1 lora_B tensors are all zeros after training (never updated), e.g. ['x.lora_B']"])

    monkeypatch.setattr(adapter_module, "check_adapter", failing)
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), "--output_dir",
            str(out), "--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--max_seq_len", "64",
            "--max_steps", "1", "--save_strategy", "no", "--report_to", "none", "--eval_strategy", "no",
            "--bf16", "False", "--per_device_train_batch_size", "2"]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    capsys.readouterr()
    code = train.run(LaunchEnv())
    captured = capsys.readouterr()
    assert code == ADAPTER_CHECK_EXIT_CODE and "Traceback" not in captured.err + captured.out
    assert "adapter check FAILED" in captured.err and "lora_B tensors are all zeros" in captured.err
    assert f"kept in {out / '_adapter-FAILED-CHECK'}" in captured.err and "Nothing was replaced" in captured.err
    assert (out / "_adapter-FAILED-CHECK" / ADAPTER_WEIGHTS).is_file() and not (out / ADAPTER_WEIGHTS).exists()


def test_the_embedding_rows_are_read_from_the_matrix_not_a_norm_the_embedding_holds(tmp_path):
    # Inkling's input embedding holds an RMSNorm (`embed_tokens.embed_norm.weight`, one row of hidden size): read
    # first, it sized the expectation's vocabulary to 64 and failed a correct adapter.
    from sft_recipe.artifacts.adapter import saved_embedding_rows

    save_file({"base_model.model.model.embed_tokens.embed_norm.weight": torch.ones(64),
               "base_model.model.model.embed_tokens.weight": torch.zeros(555, 64),
               "base_model.model.model.layers.0.q_proj.lora_A.weight": torch.zeros(8, 64)},
              str(tmp_path / ADAPTER_WEIGHTS))
    assert saved_embedding_rows(tmp_path) == 555
