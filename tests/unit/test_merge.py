"""The merge command: merged LoRA/DoRA models reproduce base+adapter, bad inputs are refused before any weight loads,
nothing is half-written, and merging inside FSDP (FSDP1 or FSDP2) is refused with the command to run instead.

Tolerance: in fp32 the merged model differs from PeftModel(base, adapter) only by float rounding (W + B@A is rounded
once when merged, while the reference adds the LoRA path at run time): measured ~3e-6 on logits of magnitude ~6, so
1e-5 absolute leaves ~3x margin and is still ~1000x smaller than what the adapters here move the logits by.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from sft_recipe import merge
from sft_recipe.merge import (
    MergeError,
    check_problem,
    main,
    merge_adapter,
    merge_and_unload_unsharded,
    plan_merge,
    refuse_merge_in_fsdp,
)
from tests.helpers import reference_and_merged_logits

FP32_ATOL = 1e-5


def _peft_model(model_dir, tokenizer=None, **lora_kwargs):
    """The tiny base (resized to `tokenizer` as training does) with an adapter whose trainable weights all moved, as
    after training: PEFT starts B at 0 (and DoRA's magnitude, modules_to_save copies at the base's values), which
    would merge to the base itself, so every trainable tensor gets a small random step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft_recipe.train.model import fit_embeddings_to_tokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if tokenizer is not None:
        fit_embeddings_to_tokenizer(base, tokenizer)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM",
                                            **lora_kwargs))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    return model


def _save_adapter(model, tokenizer, folder):
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture()
def lora_adapter(tiny, tmp_path):
    from transformers import AutoTokenizer

    return _save_adapter(_peft_model(tiny.model_dir), AutoTokenizer.from_pretrained(str(tiny.model_dir)),
                         tmp_path / "adapter")


def _safetensors_keys(folder):
    keys = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys += list(f.keys())
    return keys


@pytest.mark.parametrize("variant", ["lora", "dora", "modules_to_save"])
def test_merged_model_reproduces_base_plus_adapter(tiny, tmp_path, variant):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    kwargs = {"lora": {}, "dora": {"use_dora": True}, "modules_to_save": {"modules_to_save": ["lm_head"]}}[variant]
    adapter = _save_adapter(_peft_model(tiny.model_dir, **kwargs), tokenizer, tmp_path / "adapter")
    saved = _safetensors_keys(adapter)
    if variant == "dora":
        assert any("lora_magnitude_vector" in k for k in saved)  # really a DoRA adapter
    if variant == "modules_to_save":
        assert "base_model.model.lm_head.weight" in saved
    out = tmp_path / "merged"

    result = merge_adapter(adapter, out, log=lambda _: None)

    ids = torch.arange(0, len(tokenizer)).reshape(1, -1)[:, :96]  # many distinct rows of the vocabulary
    base_logits, reference, merged_logits, merged = reference_and_merged_logits(adapter, out, ids)
    assert (merged_logits - reference).abs().max() < FP32_ATOL
    assert (merged_logits - base_logits).abs().max() > 0.1  # the adapter is in there: not just the base again
    assert merged.dtype == torch.float32 and type(merged).__name__ == "LlamaForCausalLM"
    keys = _safetensors_keys(out)
    assert keys and not [k for k in keys if "lora" in k or "base_layer" in k or "modules_to_save" in k]
    assert result.tensors == len(keys) and result.check["max_abs_diff"] < result.check["tolerance"]
    assert not json.loads((out / "config.json").read_text()).get("quantization_config")
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]  # no temporary folder left behind
    assert "check OK" in result.summary() and "dtype float32" in result.summary()


@pytest.mark.parametrize("rows", ["full_embedding", "trainable_tokens"])
def test_added_tokens_resize_the_base_to_the_saved_tokenizer(tiny, tmp_path, rows):
    """A chatml run adds tokens: the merged model has exactly len(tokenizer) rows, the trained new rows included,
    and generation stops at the chat format's end-of-turn token. The new rows come either in the saved full
    embedding (PEFT saves it when the vocabulary grew) or as PEFT trainable-token rows (--train_new_tokens)."""
    from sft_recipe.config.args import ModelArguments
    from sft_recipe.train.model import load_tokenizer

    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format="chatml"))
    base_rows = json.loads((tiny.model_dir / "config.json").read_text())["vocab_size"]
    new_ids = list(range(base_rows, len(tokenizer)))
    assert new_ids
    if rows == "trainable_tokens":  # as sft_recipe.train.model.lora_config builds it
        model = _peft_model(tiny.model_dir, tokenizer,
                            trainable_token_indices={"embed_tokens": new_ids, "lm_head": new_ids})
    else:
        model = _peft_model(tiny.model_dir, tokenizer)
        with torch.no_grad():  # as if the new rows were trained: they must survive the merge
            model.get_input_embeddings().weight[base_rows:] = torch.randn(len(new_ids), 64)
    adapter = _save_adapter(model, tokenizer, tmp_path / "adapter")
    if rows == "trainable_tokens":
        assert any("trainable_tokens_delta" in k for k in _safetensors_keys(adapter))
    out = tmp_path / "merged"

    result = merge_adapter(adapter, out, log=lambda _: None)

    assert result.vocab_rows == len(tokenizer)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = torch.tensor([tokenizer("What is the opposite of hot?")["input_ids"] + new_ids])
    _, reference, merged_logits, merged = reference_and_merged_logits(adapter, out, ids)
    assert merged.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert (merged_logits - reference).abs().max() < FP32_ATOL
    eos = merged.generation_config.eos_token_id
    assert im_end in (eos if isinstance(eos, list) else [eos])
    assert result.check["tokens"] >= len(new_ids)  # the command's own check fed the new rows too


# ---- refusals: before any weight is loaded -----------------------------------------------------------------------


@pytest.fixture()
def no_weight_loading(monkeypatch):
    """Fail the test if anything loads model weights: refusals must come first."""
    from transformers import AutoModelForCausalLM

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", forbidden)


def _run_cli(capsys, *args):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_existing_output_dir_is_refused_without_overwrite(lora_adapter, tmp_path, capsys, no_weight_loading):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, err = _run_cli(capsys, "--adapter_dir", lora_adapter, "--output_dir", out)
    assert code == 2 and "exists and is not empty" in err and "--overwrite" in err and str(out) in err
    assert (out / "keep.txt").read_text() == "precious"


def test_overwrite_replaces_the_old_folder_only_at_the_end(lora_adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, _ = _run_cli(capsys, "--adapter_dir", lora_adapter, "--output_dir", out, "--overwrite")
    assert code == 0 and not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]


@pytest.mark.parametrize("case", ["missing", "base_model_dir", "is_adapter", "contains_adapter"])
def test_bad_folders_are_refused(tiny, lora_adapter, tmp_path, capsys, no_weight_loading, case):
    adapter, out, expected = lora_adapter, tmp_path / "merged", ""
    if case == "missing":
        adapter, expected = tmp_path / "nope", "no such folder"
    elif case == "base_model_dir":  # a model folder, not an adapter
        adapter, expected = tiny.model_dir, "holds no saved adapter"
    elif case == "is_adapter":
        out, expected = lora_adapter, "is or contains the adapter folder"
    elif case == "contains_adapter":
        out, expected = tmp_path, "is or contains the adapter folder"
    code, err = _run_cli(capsys, "--adapter_dir", adapter, "--output_dir", out, "--overwrite")
    assert code == 2 and expected in err and "Fix:" in err
    assert (lora_adapter / "adapter_model.safetensors").is_file()


def test_quantized_base_checkpoint_is_refused(tiny, lora_adapter, tmp_path, capsys, no_weight_loading):
    quantized = tmp_path / "base-4bit"
    quantized.mkdir()
    config = json.loads((tiny.model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    code, err = _run_cli(capsys, "--adapter_dir", lora_adapter, "--output_dir", tmp_path / "m",
                         "--base_model_name_or_path", quantized)
    assert code == 2 and "quantized checkpoint" in err and "--base_model_name_or_path" in err


def test_distributed_launcher_is_refused(lora_adapter, tmp_path, capsys, monkeypatch, no_weight_loading):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = _run_cli(capsys, "--adapter_dir", lora_adapter, "--output_dir", tmp_path / "merged")
    assert code == 2 and "WORLD_SIZE=2" in err and "plain command" in err and "python merge_adapter.py" in err
    monkeypatch.setenv("WORLD_SIZE", "two")  # unreadable: said as the trainer says it, exit 2, no traceback
    code, err = _run_cli(capsys, "--adapter_dir", lora_adapter, "--output_dir", tmp_path / "merged")
    assert code == 2 and "WORLD_SIZE='two': not a whole number" in err
    assert not (tmp_path / "merged").exists()


# ---- dtype: QLoRA adapters go into the bf16 base ----------------------------------------------------------------


@pytest.mark.parametrize("facts,dtype,expected", [
    ({"quantization": "4bit"}, "auto", torch.bfloat16),  # QLoRA: bf16 base, never the 4-bit one
    ({"quantization": None}, "auto", torch.float32),  # plain LoRA: the base config's dtype (tiny: float32)
    ({}, "auto", torch.float32),  # train.py that does not record it: base config dtype, and a note
    ({"quantization": "4bit"}, "float32", torch.float32),  # --dtype wins
    (None, "bfloat16", torch.bfloat16),
])
def test_dtype_choice(lora_adapter, tmp_path, no_weight_loading, facts, dtype, expected):
    if facts is not None:
        (lora_adapter / "run_record.json").write_text(json.dumps({"run": facts}))  # the run record's "run" section
    plan = plan_merge(lora_adapter, tmp_path / "merged", dtype=dtype)
    assert plan.dtype == expected
    assert bool(plan.notes) == (facts == {})  # tells the user to pass --dtype for QLoRA when it cannot know


def test_an_adapter_from_before_the_run_record_still_merges_into_the_bf16_base(lora_adapter, tmp_path,
                                                                             no_weight_loading):
    (lora_adapter / "run_facts.json").write_text(json.dumps({"quantization": "4bit"}))  # the earlier file, flat
    assert plan_merge(lora_adapter, tmp_path / "merged").dtype == torch.bfloat16


# ---- the check catches a wrong merge, and nothing is published --------------------------------------------------


def test_a_merge_that_drops_the_adapter_fails_the_check(lora_adapter, tmp_path, capsys, monkeypatch):
    from peft.tuners.lora import LoraModel

    # A broken merge (PeftModel forwards merge_and_unload to its LoraModel): unload() drops the adapter's deltas.
    monkeypatch.setattr(LoraModel, "merge_and_unload", lambda self, **kwargs: self.unload())
    out = tmp_path / "merged"
    code, err = _run_cli(capsys, "--adapter_dir", lora_adapter, "--output_dir", out)
    assert code == 1 and "does not reproduce base+adapter" in err
    assert not out.exists() and (tmp_path / "merged.FAILED-CHECK" / "model.safetensors").is_file()


def test_check_problem_rules():
    assert check_problem(1e-6, 1e-4, 5.0) is None
    assert "tolerance" in check_problem(1e-3, 1e-4, 5.0)
    assert "tolerance" in check_problem(float("nan"), 1e-4, 5.0)
    # bf16-sized tolerance larger than a weak adapter's effect: must still be closer to base+adapter than to base
    assert "half of what the adapter moves" in check_problem(0.2, 0.3, 0.35)
    assert check_problem(0.05, 0.3, 0.35) is None
    assert check_problem(0.05, 0.3, 0.01) is None  # an adapter that changes nothing measurable: noise rules


# ---- FSDP: merging inside a wrapped model is refused ------------------------------------------------------------


@pytest.fixture()
def one_rank_group(tmp_path):
    """A real 1-rank gloo process group in this process, torn down afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP1's advice on mixed requires_grad and 1-rank NO_SHARD
@pytest.mark.parametrize("wrapper", ["fsdp2", "fsdp1"])
def test_merge_inside_fsdp_is_refused(tiny, tmp_path, one_rank_group, wrapper):
    model = _peft_model(tiny.model_dir)
    refuse_merge_in_fsdp(model)  # unwrapped: fine
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        assert any(type(p).__name__ == "DTensor" for p in wrapped.parameters())
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # Decoder layers wrapped as the Trainer's TRANSFORMER_BASED_WRAP does; use_orig_params because without
        # PEFT's policy LoRA and frozen weights share a flat parameter.
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                           auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    with pytest.raises(MergeError, match="inside an FSDP-wrapped model") as refused:
        merge_and_unload_unsharded(wrapped)
    assert "python merge_adapter.py" in str(refused.value) and ("FSDP2" if wrapper == "fsdp2" else "FSDP1") in str(
        refused.value)
    # The inner PeftModel (what trainer.model is) carries the wrapped submodules: refused too.
    with pytest.raises(MergeError, match="FSDP"):
        refuse_merge_in_fsdp(model)
    # And the command itself will not run in a process that is part of a group.
    with pytest.raises(MergeError, match="process group is initialised"):
        plan_merge(tmp_path / "any", tmp_path / "out")


def test_module_documents_the_command():
    from pathlib import Path

    script = Path(merge.__file__).parents[1] / "merge_adapter.py"
    assert "python merge_adapter.py --adapter_dir" in script.read_text()
    assert "python merge_adapter.py --adapter_dir" in merge.COMMAND
