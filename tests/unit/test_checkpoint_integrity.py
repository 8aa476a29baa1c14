"""A damaged checkpoint never costs the run, and a resume with other settings is refused before anything loads.

- `latest` skips a complete checkpoint whose files fail the marker's record (sizes, checksums) or their own headers,
  says which and why, and resumes from the newest intact one; an explicit path to it is refused, the intact ones
  listed. Every case has its negative control: the intact checkpoint is taken.
- Another LoRA shape, base model or tokenizer size names both values and the fix.
- What only loading can find stops the run with exit code 2 (ResumeError is a ConfigError), the file named.
Fake checkpoint folders, no training (tests/e2e/test_resume_damaged.py runs real ones).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from sft_recipe.artifacts.checkpoints import (
    COMPLETE_MARKER,
    checkpoint_damage,
    mark_complete,
    move_damaged_aside,
    resolve_resume,
)
from sft_recipe.artifacts.resume_match import resume_mismatch_problems, run_identity, tokenizer_size_problems
from sft_recipe.artifacts.state_io import save_optimizer, save_rng_state
from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.preflight.validate import validate


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny.model_dir))


@pytest.fixture(scope="module")
def identity(tiny, tokenizer):
    """What a run with the guide's LoRA flags on the tiny model records (built the way the trainer does)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    return run_identity(peft, tokenizer)


def _checkpoint(root, step, run=None, legacy=False):
    """A checkpoint folder with the files a one-process LoRA run writes (small ones), marked complete."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": "base", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
        "use_dora": False, "modules_to_save": None, "peft_type": "LORA"}))
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(4)
    optimizer.step()
    save_optimizer(optimizer, path / "optimizer.safetensors")
    save_rng_state(path / "rng_state.safetensors")
    (path / "scheduler.json").write_text(json.dumps({"last_epoch": step, "_step_count": step + 1}))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}, indent=1))
    if legacy:  # a marker of an earlier version: no files, no run recorded
        (path / COMPLETE_MARKER).write_text(json.dumps({"global_step": step, "time": 0}))
    else:
        mark_complete(path, step, run=run)
    return path


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _garble_same_size(path):
    raw = path.read_bytes()
    path.write_bytes(raw[:-5] + b"#####")


# (damage, marker of this version or an earlier one, what the message says)
DAMAGE = {
    "truncated optimizer": (lambda c: _truncate(c / "optimizer.safetensors", 300), False,
                            "optimizer.safetensors is 300 bytes, "),
    "zero-byte adapter": (lambda c: _truncate(c / "adapter_model.safetensors", 0), False,
                          "adapter_model.safetensors is 0 bytes, "),
    "RNG state missing": (lambda c: (c / "rng_state.safetensors").unlink(), False, "rng_state.safetensors is missing"),
    "scheduler missing": (lambda c: (c / "scheduler.json").unlink(), False, "scheduler.json is missing"),
    "trainer state missing": (lambda c: (c / "trainer_state.json").unlink(), False, "trainer_state.json is missing"),
    "trainer state garbled": (lambda c: _garble_same_size(c / "trainer_state.json"), False,
                              "trainer_state.json changed since it was saved (its SHA-256 differs)"),
    "scheduler garbled": (lambda c: _garble_same_size(c / "scheduler.json"), False,
                          "scheduler.json changed since it was saved"),
    "RNG state garbled": (lambda c: _garble_same_size(c / "rng_state.safetensors"), False,
                          "rng_state.safetensors changed since it was saved"),
    "marker cut short": (lambda c: _truncate(c / COMPLETE_MARKER, 20), False,
                         "checkpoint_complete.json is not valid JSON"),
    "earlier version: truncated optimizer": (lambda c: _truncate(c / "optimizer.safetensors", 300), True,
                                             "optimizer.safetensors is truncated"),
    "earlier version: zero-byte adapter": (lambda c: _truncate(c / "adapter_model.safetensors", 0), True,
                                           "adapter_model.safetensors is empty (0 bytes)"),
    "earlier version: trainer state garbled": (lambda c: _truncate(c / "trainer_state.json", 10), True,
                                               "trainer_state.json is not valid JSON"),
    "earlier version: trainer state missing": (lambda c: (c / "trainer_state.json").unlink(), True,
                                               "trainer_state.json is missing"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_latest_skips_a_damaged_checkpoint_and_an_explicit_path_to_it_is_refused(case, tmp_path, caplog):
    damage, legacy, expected = DAMAGE[case]
    _checkpoint(tmp_path, 1, legacy=legacy)
    newest = _checkpoint(tmp_path, 2, legacy=legacy)
    assert checkpoint_damage(newest) == []
    assert resolve_resume("latest", str(tmp_path)) == (str(newest), [])  # the negative control
    damage(newest)
    problems = checkpoint_damage(newest)
    assert len(problems) == 1 and expected in problems[0], problems
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("latest", str(tmp_path)) == (str(tmp_path / "checkpoint-1"), [])
    assert f"resuming from {tmp_path / 'checkpoint-1'}, the newest intact checkpoint; skipped as damaged: " \
           "checkpoint-2 (" in caplog.text and expected in caplog.text
    _, (problem,) = resolve_resume(str(newest), str(tmp_path))
    assert f"--resume_from_checkpoint {newest}: damaged: {expected}" in problem
    assert f"Fix: --resume_from_checkpoint {tmp_path / 'checkpoint-1'} (intact here: checkpoint-1)" in problem


def test_no_intact_checkpoint_left_says_so_and_how_to_start_afresh(tmp_path):
    only = _checkpoint(tmp_path, 3)
    _truncate(only / "optimizer.safetensors", 10)
    (tmp_path / "checkpoint-4").mkdir()  # a save killed half-way
    _, (problem,) = resolve_resume("latest", str(tmp_path))
    assert f"no intact checkpoint in {tmp_path} (1 incomplete ones skipped); damaged: checkpoint-3 (" in problem
    assert "--overwrite_output_dir True" in problem and "nothing is deleted" in problem
    _, (problem,) = resolve_resume(str(only), str(tmp_path))
    assert "no intact checkpoint is left beside it" in problem


def test_a_marker_records_sizes_and_checksums_of_the_small_files(tmp_path):
    path = _checkpoint(tmp_path, 5)
    files = json.loads((path / COMPLETE_MARKER).read_text())["files"]
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors",
                          "rng_state.safetensors", "scheduler.json", "trainer_state.json"}
    assert all(record["size"] == (path / name).stat().st_size and len(record["sha256"]) == 64
               for name, record in files.items())


def test_damaged_checkpoints_newer_than_the_resume_move_aside_and_nothing_is_deleted(tmp_path):
    old_damaged = _checkpoint(tmp_path, 1)
    _truncate(old_damaged / "optimizer.safetensors", 10)
    intact = _checkpoint(tmp_path, 2)
    newer = _checkpoint(tmp_path, 3)
    _truncate(newer / "optimizer.safetensors", 10)
    before = {p.name: p.read_bytes() for p in newer.iterdir()}
    assert move_damaged_aside(tmp_path, str(intact), main=False) is None  # other ranks leave it to the main one
    aside = move_damaged_aside(tmp_path, str(intact))
    assert not newer.exists() and {p.name: p.read_bytes() for p in (aside / "checkpoint-3").iterdir()} == before
    assert old_damaged.exists() and intact.exists()  # older than the resume: the run never writes over them
    assert move_damaged_aside(tmp_path, str(intact)) is None


# --- resume with other settings --------------------------------------------------------------------------------------

def _resume_problems(tiny, checkpoint, tmp_path, *extra, model=None):
    argv = ["--model_name_or_path", str(model or tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", str(checkpoint), "--use_peft_lora",
            "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear", *extra]
    try:
        validate(*parse_args(argv))
    except ConfigError as e:
        return "\n".join(e.problems)
    return ""


LORA_MISMATCH = {
    "rank": (["--lora_r", "16"], "(--lora_r 16 now, 8 in the checkpoint)", "the checkpoint's settings (--lora_r 8)"),
    "alpha": (["--lora_alpha", "32"], "--lora_alpha 32 now, 16 in the checkpoint", "(--lora_alpha 16)"),
    "targets": (["--lora_target_modules", "q_proj,v_proj"], "--lora_target_modules q_proj,v_proj now, down_proj,",
                "(--lora_target_modules down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj)"),
    "DoRA": (["--use_dora", "True"], "--use_dora True now, False in the checkpoint", "(--use_dora False)"),
    "modules_to_save": (["--lora_modules_to_save", "lm_head"], "--lora_modules_to_save lm_head now, '' in the",
                        "(--lora_modules_to_save '')"),
    "no LoRA": (["--use_peft_lora", "False"], "holds a LoRA adapter (r 8), but --use_peft_lora is False",
                "Fix: --use_peft_lora True with the checkpoint's LoRA settings"),
}


@pytest.mark.parametrize("case", list(LORA_MISMATCH))
def test_a_resume_with_another_lora_shape_is_refused_naming_both_values(case, tiny, identity, tmp_path):
    extra, says, fix = LORA_MISMATCH[case]
    checkpoint = _checkpoint(tmp_path / "run", 2, run=identity)
    assert _resume_problems(tiny, checkpoint, tmp_path) == ""  # the checkpoint's own settings: resumes
    message = _resume_problems(tiny, checkpoint, tmp_path, *extra)
    assert says in message and fix in message and "or a fresh --output_dir" in message, message


def test_a_full_fine_tuning_checkpoint_is_not_resumed_with_lora(tiny, identity, tmp_path):
    checkpoint = _checkpoint(tmp_path / "run", 2, run={**identity, "lora": None})
    assert _resume_problems(tiny, checkpoint, tmp_path, "--use_peft_lora", "False") == ""
    assert "holds no LoRA adapter (it was trained in full)" in _resume_problems(tiny, checkpoint, tmp_path)


def test_an_earlier_versions_checkpoint_is_compared_through_its_adapter_config(tiny, tmp_path):
    checkpoint = _checkpoint(tmp_path / "run", 2, legacy=True)  # adapter_config.json: r 8, target q_proj
    assert _resume_problems(tiny, checkpoint, tmp_path, "--lora_target_modules", "q_proj") == ""
    assert "(--lora_r 4 now, 8 in the checkpoint)" in _resume_problems(
        tiny, checkpoint, tmp_path, "--lora_r", "4", "--lora_target_modules", "q_proj")
    m = SimpleNamespace(model_name_or_path="org/other", use_peft_lora=True, lora_r=8, lora_alpha=16,
                        lora_target_modules="q_proj", use_dora=False, lora_modules_to_save="",
                        modules_to_save=[])
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    (checkpoint / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/base"}))
    (problem,) = resume_mismatch_problems(str(checkpoint), m)  # two Hub ids
    assert "was trained on org/base, but --model_name_or_path is org/other" in problem
    assert resume_mismatch_problems(str(checkpoint), SimpleNamespace(**{**vars(m), "model_name_or_path": "org/base"})) \
        == []


@pytest.fixture()
def other_bases(tiny, tmp_path):
    """(another architecture, the same architecture with other weights, the tiny model under another path)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tiny.model_dir))
    config.hidden_size, config.head_dim = 32, 8
    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(config).save_pretrained(str(other))
    shutil.copy(tiny.model_dir / "tokenizer.json", other)
    shutil.copy(tiny.model_dir / "tokenizer_config.json", other)
    variant = tmp_path / "variant"
    shutil.copytree(tiny.model_dir, variant)
    tensors = load_file(str(tiny.model_dir / "model.safetensors"))
    save_file({k: v + 0.01 if k.endswith("q_proj.weight") else v for k, v in tensors.items()},
              str(variant / "model.safetensors"), metadata={"format": "pt"})
    moved = tmp_path / "moved"
    shutil.copytree(tiny.model_dir, moved)
    return other, variant, moved


def test_a_resume_on_another_base_model_is_refused(tiny, identity, other_bases, tmp_path):
    other, variant, moved = other_bases
    checkpoint = _checkpoint(tmp_path / "run", 2, run=identity)
    assert _resume_problems(tiny, checkpoint, tmp_path, model=moved) == ""  # the same weights elsewhere: resumes
    message = _resume_problems(tiny, checkpoint, tmp_path, model=other)
    assert f"was trained on {tiny.model_dir}, but --model_name_or_path is {other}, another model (hidden_size 64 " \
           "there, 32 here)" in message
    assert f"Fix: --model_name_or_path {tiny.model_dir} (the checkpoint's base), or a fresh --output_dir" in message
    message = _resume_problems(tiny, checkpoint, tmp_path, model=variant)
    assert "the same architecture with other weights (their sampled tensors differ" in message


def test_a_chat_format_run_resumes_with_its_own_settings(tiny, tmp_path):
    """The run grows the embeddings (and the config's vocab_size) to the chat format's tokens: not another base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.config.args import ModelArguments
    from sft_recipe.train.model import fit_embeddings_to_tokenizer, load_tokenizer

    chatml = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format="chatml"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    assert fit_embeddings_to_tokenizer(model, chatml)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    checkpoint = _checkpoint(tmp_path / "run", 2, run=run_identity(peft, chatml))
    assert _resume_problems(tiny, checkpoint, tmp_path, "--chat_template_format", "chatml") == ""
    assert tokenizer_size_problems(str(checkpoint), chatml) == []


def test_a_resume_with_another_tokenizer_size_is_refused(tiny, identity, tokenizer, tmp_path):
    from sft_recipe.config.args import ModelArguments
    from sft_recipe.train.model import load_tokenizer

    checkpoint = _checkpoint(tmp_path / "run", 2, run=identity)
    assert tokenizer_size_problems(str(checkpoint), tokenizer) == []
    chatml = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format="chatml"))
    (problem,) = tokenizer_size_problems(str(checkpoint), chatml)
    assert f"was trained with a tokenizer of {len(tokenizer)} tokens; this launch's has {len(chatml)}" in problem
    assert "Fix: the checkpoint's --model_name_or_path and --chat_template_format, or a fresh --output_dir" in problem


# --- found while loading -------------------------------------------------------------------------------------------

@pytest.fixture()
def trainer(tiny, tokenizer, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from sft_recipe import compat
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.train.trainer import RecipeSFTTrainer

    compat.install(LaunchEnv())
    tokenizer.pad_token = tokenizer.eos_token
    trainer = RecipeSFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)),
        args=SFTConfig(output_dir=str(tmp_path / "trainer"), report_to="none", bf16=False, use_cpu=True),
        train_dataset=Dataset.from_list([{"text": "hello world"}] * 4), processing_class=tokenizer,
        peft_config=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    return trainer


def test_what_only_loading_finds_stops_with_exit_2_and_the_file_named(trainer, tmp_path):
    from sft_recipe.train.trainer import ResumeError

    assert issubclass(ResumeError, ConfigError)  # train.py exits 2 with the message, no traceback
    intact = _checkpoint(tmp_path / "run", 1)
    damaged = _checkpoint(tmp_path / "run", 2)
    (damaged / "rng_state.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ResumeError, match=r"rng_state.safetensors cannot be loaded \(SafetensorError: .*Fix: "
                                          rf"--resume_from_checkpoint {intact} \(intact: checkpoint-1\)"):
        trainer._load_rng_state(str(damaged))
    (damaged / "scheduler.json").write_text("{")
    trainer._save_optimizer_and_scheduler(str(damaged))  # a fresh optimizer, and the scheduler file rewritten
    (damaged / "scheduler.json").write_text("{")
    with pytest.raises(ResumeError, match=r"scheduler.json cannot be loaded \(JSONDecodeError"):
        trainer._load_optimizer_and_scheduler(str(damaged))
    (damaged / "optimizer.safetensors").write_bytes(os.urandom(64))
    with pytest.raises(ResumeError, match="optimizer.safetensors cannot be loaded"):
        trainer._load_optimizer_and_scheduler(str(damaged))


def test_an_adapter_of_another_shape_stops_with_exit_2(trainer, tiny, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.train.trainer import ResumeError

    other = tmp_path / "run" / "checkpoint-2"
    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")).save_pretrained(other)
    with pytest.raises(ResumeError, match=r"its model/adapter weights cannot be loaded \(RuntimeError: Error\(s\) in "
                                          r"loading state_dict.*Fix: a fresh --output_dir"):
        trainer._load_from_checkpoint(str(other))
