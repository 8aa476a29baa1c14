"""No check switches itself off in silence: each pre-load check whose own machinery fails (a config that will not
read, a planner that cannot count a model, a tokenizer that will not load) says so in one WARNING naming the check,
and the problems the other checks found still stand (sft_recipe.errors.check_not_run). Each test injects the
failure into the one thing its check needs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sft_recipe.config.args import parse_args
from sft_recipe.config.launch_env import LaunchEnv

INJECTED = "injected for this test"


def _boom(*args, **kwargs):
    raise RuntimeError(INJECTED)


def _said(caplog, check: str) -> bool:
    return any(r.levelno == logging.WARNING and check in r.getMessage() and INJECTED in r.getMessage()
               for r in caplog.records)


def _args(tiny, tmp_path, *extra):
    return parse_args(["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
                       "--output_dir", str(tmp_path / "out"), *extra], LaunchEnv())


@pytest.mark.parametrize("broken,check", [("flash_attention_problem", "the flash-attention check"),
                                          ("tied_training_problem", "the tied-embedding check")])
def test_one_architecture_check_failing_keeps_the_others_findings(broken, check, tiny, tmp_path, monkeypatch, caplog):
    from sft_recipe.model import architecture

    m, _, _, t = _args(tiny, tmp_path)
    other = "tied_training_problem" if broken == "flash_attention_problem" else "flash_attention_problem"
    monkeypatch.setattr(architecture, broken, _boom)
    monkeypatch.setattr(architecture, other, lambda *a, **k: "the other check's refusal")
    with caplog.at_level(logging.WARNING):
        problems = architecture.architecture_problems(m, t, LaunchEnv())
    assert "the other check's refusal" in problems  # before: every finding was dropped with the failure
    assert _said(caplog, check)


def test_the_family_rules_failing_is_said(tiny, tmp_path, monkeypatch, caplog):
    from sft_recipe.model import family_rules

    m, _, _, t = _args(tiny, tmp_path)
    monkeypatch.setattr(family_rules, "family_problems", _boom)
    with caplog.at_level(logging.WARNING):
        from sft_recipe.model.architecture import architecture_problems

        architecture_problems(m, t, LaunchEnv())
    assert _said(caplog, "the model family's rules")


def test_disk_space_not_estimated_is_said(tiny, tmp_path, monkeypatch, caplog):
    from sft_recipe.preflight import disk_space

    m, d, _, t = _args(tiny, tmp_path)
    monkeypatch.setattr(disk_space, "estimate_writes", _boom)
    with caplog.at_level(logging.WARNING):
        assert disk_space.disk_space_problems(m, d, t, LaunchEnv()) == []
    assert _said(caplog, f"the disk-space check of --output_dir {t.output_dir}")


def test_the_qlora_zero3_load_check_failing_is_said(tiny, tmp_path, monkeypatch, caplog):
    from sft_recipe.plan import planner
    from sft_recipe.preflight.load_checks import zero3_quantized_load_problems

    m, d, _, t = _args(tiny, tmp_path, "--use_4bit_quantization", "True")
    launch = SimpleNamespace(use_deepspeed=True, deepspeed_zero_stage="3", is_main_process=True,
                             accelerate_config=lambda: {})
    monkeypatch.setattr(planner, "plan_memory", _boom)
    with caplog.at_level(logging.WARNING):
        assert zero3_quantized_load_problems(m, d, t, launch, gpu_bytes=24 * 2**30) == []
    assert _said(caplog, "the QLoRA + ZeRO-3 load-memory check")


@pytest.mark.parametrize("target,check", [
    ("sft_recipe.train.model.load_tokenizer", "the --eos_token/--pad_token check"),
    ("sft_recipe.model.shape.read_config", "the checks that read the model's config"),
])
def test_trainer_checks_failing_are_said(target, check, tiny, tmp_path, monkeypatch, caplog):
    from sft_recipe.preflight import trainer_checks

    m, _, _, t = _args(tiny, tmp_path, "--eos_token", "</s>")
    monkeypatch.setattr(target, _boom)
    with caplog.at_level(logging.WARNING):
        if "load_tokenizer" in target:
            trainer_checks.tokenizer_flag_problems(m, t)
        else:
            assert trainer_checks._read_config(m, t) is None
    assert _said(caplog, check)


def test_the_position_check_failing_is_said(tiny, tmp_path, monkeypatch, caplog):
    from sft_recipe.model.shape import read_config
    from sft_recipe.preflight import trainer_checks

    m, _, _, t = _args(tiny, tmp_path, "--max_seq_len", "100000")  # beyond the tiny model's positions
    monkeypatch.setattr(trainer_checks, "_position_kind", _boom)
    with caplog.at_level(logging.WARNING):
        assert trainer_checks.position_problems(m, t, read_config(m.model_name_or_path)) == []
    assert _said(caplog, "the --max_seq_len 100000 position check")


def test_the_tokenizer_size_check_failing_is_said(tiny, tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from sft_recipe.preflight.file_checks import check_tokenizer

    m, _, _, t = _args(tiny, tmp_path)
    monkeypatch.setattr("sft_recipe.model.shape.read_config", _boom)
    with caplog.at_level(logging.WARNING):
        check_tokenizer(m, AutoTokenizer.from_pretrained(str(tiny.model_dir)), None)
    assert _said(caplog, "the tokenizer-vs-embeddings size check")


def test_the_pre_quantized_checkpoint_check_failing_is_said(tiny, tmp_path, monkeypatch, caplog):
    from transformers.quantizers.auto import AutoHfQuantizer

    from sft_recipe.preflight.trainer_checks import quantized_checkpoint_problems

    m, _, _, t = _args(tiny, tmp_path)
    config = SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 4})
    monkeypatch.setattr(AutoHfQuantizer, "from_config", _boom)
    with caplog.at_level(logging.WARNING):
        assert quantized_checkpoint_problems(m, config) == []
    assert _said(caplog, "the pre-quantized checkpoint check")
