"""Checkpoint completeness, resume resolution, protecting a previous run's results, and the empty-resume guard."""

import pytest

from sft_recipe.artifacts.checkpoints import (
    COMPLETE_MARKER,
    latest_complete_checkpoint,
    mark_complete,
    move_previous_run_aside,
    resolve_resume,
)
from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.preflight.validate import validate


def _checkpoint(root, step, complete=True):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        mark_complete(path, step)
    return path


def test_latest_complete_skips_newer_incomplete_ones(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 12)
    _checkpoint(tmp_path, 16, complete=False)
    (tmp_path / "checkpoint-x").mkdir()
    path, skipped = latest_complete_checkpoint(tmp_path)
    assert path.name == "checkpoint-12" and [p.name for p in skipped] == ["checkpoint-16"]
    assert resolve_resume("latest", str(tmp_path)) == (str(path), [])


def test_resume_problems_name_the_fix(tmp_path):
    _checkpoint(tmp_path, 3, complete=False)
    assert "no complete checkpoint" in resolve_resume("latest", str(tmp_path))[1][0]
    assert "1 incomplete ones skipped" in resolve_resume("latest", str(tmp_path))[1][0]
    assert "incomplete checkpoint" in resolve_resume(str(tmp_path / "checkpoint-3"), str(tmp_path))[1][0]
    assert "no such checkpoint folder" in resolve_resume(str(tmp_path / "nope"), str(tmp_path))[1][0]
    assert resolve_resume(None, str(tmp_path)) == (None, [])


def test_marker_is_written_whole(tmp_path):
    mark_complete(tmp_path, 7)
    assert (tmp_path / COMPLETE_MARKER).read_text().startswith('{"global_step": 7')
    assert not list(tmp_path.glob(".*.writing-*"))  # sft_recipe.atomic.write_atomically's temporary name


def test_an_interrupted_write_leaves_the_previous_file_whole(tmp_path):
    from sft_recipe.atomic import write_atomically

    target = tmp_path / "scheduler.json"
    target.write_text("previous")
    seen = []

    def crash(tmp):
        seen.append(tmp)
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(target, crash)
    assert target.read_text() == "previous"
    assert seen and seen[0].match(".*.writing-*")  # the pattern the test above looks for
    assert not seen[0].exists()  # removed: a full disk leaves no partial file (nor its space) behind


def test_a_previous_run_is_not_overwritten_without_a_choice(tiny, tmp_path):
    out = tmp_path / "out"
    _checkpoint(out, 8)
    (out / "adapter_model.safetensors").write_bytes(b"x")
    base = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(out)]
    with pytest.raises(ConfigError, match="holds a previous run .adapter_model.safetensors, checkpoint-8"):
        validate(*parse_args(base))
    validate(*parse_args(base + ["--overwrite_output_dir", "True"]))
    validate(*parse_args(base + ["--resume_from_checkpoint", "latest"]))


def test_overwrite_moves_old_checkpoints_aside_and_deletes_nothing(tmp_path):
    _checkpoint(tmp_path, 8)
    (tmp_path / "checkpoint-8" / "weights").write_text("keep me")
    (tmp_path / "preempted.json").write_text("{}")  # a stale note would make the scripts report a preemption
    aside = move_previous_run_aside(tmp_path)
    assert (aside / "checkpoint-8" / "weights").read_text() == "keep me" and (aside / "preempted.json").exists()
    assert not (tmp_path / "checkpoint-8").exists()
    assert move_previous_run_aside(tmp_path) is None


def _hub_ignore_patterns(method) -> list[str]:
    """The ignore_patterns transformers' own push passes to upload_folder, read from its source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "attr", "") ==
             "upload_folder"]
    (keyword,) = [k for call in calls for k in call.keywords if k.arg == "ignore_patterns"]
    return [ast.literal_eval(e) if isinstance(e, ast.Constant) else "checkpoint-*" for e in keyword.value.elts]


def test_what_a_run_moves_aside_in_output_dir_never_goes_to_the_hub(tmp_path):
    """transformers uploads output_dir but `_*` and `checkpoint-*` (push_to_hub, and every save with hub_strategy
    every_save): a previous run's checkpoints, damaged ones and a failed adapter, kept in output_dir, stay on the
    machine. Checked with huggingface_hub's own filter and transformers' own patterns."""
    from huggingface_hub.utils import filter_repo_objects
    from transformers import Trainer

    from sft_recipe.artifacts.adapter import writing_folder

    out = tmp_path / "run"
    _checkpoint(out, 4)
    (out / "checkpoint-4" / "optimizer.pt").write_text("state")
    previous = move_previous_run_aside(out)
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md"):
        (out / name).write_text("adapter")
    (out / "_adapter-FAILED-CHECK").mkdir()  # the name adapter.py keeps a failed check's files under
    (out / "_adapter-FAILED-CHECK" / "adapter_model.safetensors").write_text("failed")
    writing_folder(out).mkdir()
    (writing_folder(out) / "adapter_model.safetensors").write_text("half-written")
    files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    for method in (Trainer.push_to_hub, Trainer._push_from_checkpoint):
        patterns = _hub_ignore_patterns(method)
        assert "_*" in patterns, patterns
        uploaded = set(filter_repo_objects(files, ignore_patterns=patterns))
        assert uploaded == {"adapter_model.safetensors", "adapter_config.json", "README.md"}, (method, uploaded)
    assert previous.name.startswith("_previous-run-")


def test_a_resume_that_loads_nothing_stops_the_run(tiny, tmp_path, monkeypatch):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from sft_recipe import compat
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.train.trainer import RecipeSFTTrainer, ResumeError

    compat.install(LaunchEnv())
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    tokenizer.pad_token = tokenizer.eos_token
    trainer = RecipeSFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(tiny.model_dir)),
        args=SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True),
        train_dataset=Dataset.from_list([{"text": "hello world"}] * 4), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    monkeypatch.setattr(SFTTrainer, "_load_from_checkpoint", lambda self, path, model=None: None)  # loads nothing
    with pytest.raises(ResumeError, match="loaded no trainable weights"):
        trainer._load_from_checkpoint(str(tmp_path))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    with pytest.raises(ResumeError, match="has no optimizer.safetensors"):  # not one of ours: no pickle fallback
        trainer._load_optimizer_and_scheduler(str(tmp_path))
    trainer._save_optimizer_and_scheduler(str(tmp_path))  # a fresh optimizer: files present, no Adam moments in them
    with pytest.raises(ResumeError, match="restored no optimizer state"):
        trainer._load_optimizer_and_scheduler(str(tmp_path))


def test_a_resume_on_other_ranks_must_keep_the_global_batch(tmp_path):
    from sft_recipe.artifacts.checkpoints import mark_complete, resume_layout_problems

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    mark_complete(checkpoint, 4, world_size=2, global_batch_size=8)  # 2 ranks x 2 x accumulation 2
    assert resume_layout_problems(str(checkpoint), 2, 1, 4) == []  # 4 ranks x 2 x 1: the same global batch
    assert resume_layout_problems(str(checkpoint), 2, 2, 2) == []
    (problem,) = resume_layout_problems(str(checkpoint), 2, 2, 4)  # 16: the schedule would not continue
    assert "global batch of 8" in problem and "gives 16" in problem
    assert "--gradient_accumulation_steps 1 on 4 ranks" in problem
    (problem,) = resume_layout_problems(str(checkpoint), 3, 1, 3)
    assert "divides it" in problem
    legacy = tmp_path / "checkpoint-2"
    legacy.mkdir()
    mark_complete(legacy, 2)  # no layout recorded (an earlier version): nothing to compare, no refusal
    assert resume_layout_problems(str(legacy), 2, 2, 4) == []
