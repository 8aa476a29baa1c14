"""What the guide lists as untested or broken, made to work (or refused up front, see tests/unit/test_validate.py):

- the rows of the tokens chatml adds are trained and saved: PEFT trainable tokens in one process, under FSDP2
  (the guide's FSDP2 settings: cpu_ram_efficient_loading), FSDP1 (original parameters kept) and DeepSpeed ZeRO-3
  (the last two on the one-process run's batches: its rows), `modules_to_save` (embed_tokens, lm_head) under FSDP2;
  all reload with the standard loaders and merge, and the rows alone cost a fraction of the full matrices;
- 8-bit (paged) AdamW from bitsandbytes checkpoints and resumes exactly in one process.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import RELATIVE_TOLERANCE, TRAIN_FLAGS, launch_env, launch_train


def _new_token_ids(out, tiny):
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(str(tiny.model_dir)).vocab_size
    return list(range(vocab, len(AutoTokenizer.from_pretrained(str(out)))))


def _merged_embedding_rows(out, tmp_path, ids):
    from transformers import AutoModelForCausalLM

    from sft_recipe.merge import merge_adapter

    merge_adapter(str(out), str(tmp_path / "merged"), log=lambda *a: None)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    return (merged.get_input_embeddings().weight[ids].detach(), merged.get_output_embeddings().weight[ids].detach())


CONFIGS = {"single": "cpu/single.yaml", "fsdp2": "cpu/fsdp2_config.yaml", "fsdp1": "cpu/fsdp_config.yaml",
           "zero3": "cpu/deepspeed_config.yaml"}
# FSDP1 trains the rows keeping original parameters (the guide's YAML says false: the launcher's flag overrides it),
# on 2 x 2 rows a step: the one-process run's batch of 4, so that its rows are the one-process rows.
# ZeRO-3 on CPU: gloo, fp32, no CPU switch (tests/test_deepspeed.py says why); 2 x 2 rows a step as well.
LAUNCHED_AS = {"fsdp1": (("--fsdp_use_orig_params", "true"), ["--per_device_train_batch_size", "2"]),
               "zero3": ((), ["--per_device_train_batch_size", "2", "--ddp_backend", "gloo", "--bf16", "False"])}


@pytest.fixture(scope="module")
def new_token_runs(tiny, tmp_path_factory):
    """(engine, how) -> the run that trains the chatml tokens' rows: `how` "rows" (--train_new_tokens) or "full"
    (--lora_modules_to_save embed_tokens,lm_head); each launched once, on first use."""
    runs = {}

    def run(engine: str, how: str):
        if (engine, how) not in runs:
            out = tmp_path_factory.mktemp(f"{engine}-{how}") / "out"
            trained = ["--train_new_tokens", "True"] if how == "rows" else \
                ["--lora_modules_to_save", "embed_tokens,lm_head"]
            launcher_args, extra = LAUNCHED_AS.get(engine, ((), []))
            runs[engine, how] = launch_train(CONFIGS[engine], out, [
                "--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
                "--chat_template_format", "chatml", *trained, *TRAIN_FLAGS, *extra], launcher_args=launcher_args,
                env=launch_env(cpu_switch=engine != "zero3"))
        return runs[engine, how]

    return run


@pytest.mark.parametrize("engine", list(CONFIGS))
def test_new_token_rows_train_in_one_process_and_under_fsdp(new_token_runs, tiny, tmp_path, engine):
    result = new_token_runs(engine, "rows")
    out = result.output_dir
    assert result.returncode == 0, result.output[-6000:]
    assert "adapter check OK" in result.output and "keep random embedding" not in result.output
    if engine != "single":
        how = result.record["distribution"]
        assert (how["distributed_type"], how["fsdp_version"], how["num_processes"]) == \
            (("DEEPSPEED", None, 2) if engine == "zero3" else ("FSDP", int(engine[-1]), 2))
    ids = _new_token_ids(out, tiny)
    assert len(ids) == 3  # <|im_start|>, <|im_end|>, <pad>

    saved = load_file(str(out / "adapter_model.safetensors"))
    rows = {}
    for layer, key in (("embed", "model.embed_tokens"), ("head", "lm_head")):
        delta = saved[f"base_model.model.{key}.token_adapter.trainable_tokens_delta"]
        initial = saved[f"base_model.model.{key}.token_adapter.base_layer.weight"][ids]
        assert delta.shape == initial.shape == (3, 64)
        assert (delta - initial).abs().max() > 1e-3, f"{layer}: the new rows did not move"
        rows[layer] = delta

    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        torch.testing.assert_close(loaded.get_input_embeddings()(torch.tensor(ids)), rows["embed"])
    merged_embed, merged_head = _merged_embedding_rows(out, tmp_path, ids)
    torch.testing.assert_close(merged_embed, rows["embed"])
    torch.testing.assert_close(merged_head, rows["head"])
    if engine in ("fsdp1", "zero3"):  # the one-process run's batches: the same rows (FSDP1 measured within 5e-8)
        single = load_file(str(new_token_runs("single", "rows").output_dir / "adapter_model.safetensors"))
        for key in ("model.embed_tokens", "lm_head"):
            name = f"base_model.model.{key}.token_adapter.trainable_tokens_delta"
            assert float((saved[name] - single[name]).norm() / single[name].norm()) < RELATIVE_TOLERANCE, key
    if engine == "zero3":
        # What the rows way spares under ZeRO-3, where the full way (modules_to_save) is not offered: it trains what
        # one process trains, counted through DeepSpeed's partitioned parameters, 2 x (vocabulary + 3) x hidden
        # fewer than FSDP2's full way on the same model.
        single, full = new_token_runs("single", "rows").record, new_token_runs("fsdp2", "full").record
        trained = result.record["weights"]["trainable_params"]
        assert trained == single["weights"]["trainable_params"]
        from transformers import AutoConfig

        vocab, hidden = AutoConfig.from_pretrained(str(tiny.model_dir)).vocab_size, 64
        assert full["weights"]["trainable_params"] - trained == 2 * (vocab + 3) * hidden - 2 * 3 * hidden
        print(f"zero3: trainable parameters {trained:,} (rows) vs {full['weights']['trainable_params']:,} (FSDP2, "
              f"full); peak RSS per rank, MiB: {result.record['memory']['peak_rss_mib_per_rank']} vs "
              f"{full['memory']['peak_rss_mib_per_rank']}")


def test_under_fsdp2_the_rows_alone_train_instead_of_both_matrices(new_token_runs, tiny):
    """The same FSDP2 run with the new rows trained (--train_new_tokens) and with both matrices trained in full
    (--lora_modules_to_save embed_tokens,lm_head): the full way trains 2 x vocabulary x hidden parameters more
    (the tiny Llama's untied 512 x 64 embedding and head), the rows way 2 x 3 x 64; each saved adapter holds what it
    trained. At Llama-2-70B (32,003 x 8,192 after chatml) that is 49,152 parameters against 524 million, whose fp32
    weights, gradients and Adam state (16 bytes each) are 8.4 GB."""
    from transformers import AutoConfig

    rows, full = new_token_runs("fsdp2", "rows"), new_token_runs("fsdp2", "full")
    assert rows.returncode == 0 and full.returncode == 0, (rows.output[-3000:], full.output[-3000:])
    vocab, hidden = AutoConfig.from_pretrained(str(tiny.model_dir)).vocab_size, 64
    rows_trained = rows.record["weights"]["trainable_params"]
    full_trained = full.record["weights"]["trainable_params"]
    # both train the same LoRA layers; beside them, 3 rows of each matrix against both matrices of vocab + 3 rows
    assert full_trained - rows_trained == 2 * (vocab + 3) * hidden - 2 * 3 * hidden
    adapter_bytes = {name: (run.output_dir / "adapter_model.safetensors").stat().st_size for name, run in
                     (("rows", rows), ("full", full))}
    # the full way saves each matrix twice (the trained copy and the original module), the rows way the base too
    assert adapter_bytes["rows"] < adapter_bytes["full"]
    print(f"fsdp2: trainable parameters {rows_trained:,} (rows) vs {full_trained:,} (full); adapter bytes "
          f"{adapter_bytes}; peak RSS per rank, MiB: {rows.record['memory']['peak_rss_mib_per_rank']} vs "
          f"{full.record['memory']['peak_rss_mib_per_rank']}")


def test_modules_to_save_train_new_rows_under_fsdp2(new_token_runs, tiny, tmp_path):
    result = new_token_runs("fsdp2", "full")
    out = result.output_dir
    assert result.returncode == 0, result.output[-6000:]
    how = result.record["distribution"]
    assert how["distributed_type"] == "FSDP" and how["fsdp_version"] == 2
    assert "adapter check OK" in result.output
    ids = _new_token_ids(out, tiny)
    saved = load_file(str(out / "adapter_model.safetensors"))
    trained = {}
    for key in ("model.embed_tokens", "lm_head"):
        copy = saved[f"base_model.model.{key}.modules_to_save.weight"]
        original = saved[f"base_model.model.{key}.original_module.weight"]
        assert (copy[ids] - original[ids]).abs().max() > 1e-3, f"{key}: the new rows did not move"
        trained[key] = copy

    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(loaded.get_input_embeddings().weight, trained["model.embed_tokens"])
    merged_embed, merged_head = _merged_embedding_rows(out, tmp_path, ids)
    torch.testing.assert_close(merged_embed, trained["model.embed_tokens"][ids])
    torch.testing.assert_close(merged_head, trained["lm_head"][ids])


def test_8bit_paged_optimizer_checkpoints_and_resumes_in_one_process(tiny, tmp_path):
    # r=64: LoRA matrices of 64x64 = 4096 values reach bitsandbytes' 8-bit threshold (smaller ones stay 32-bit).
    flags = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *TRAIN_FLAGS,
             "--optim", "paged_adamw_8bit", "--lora_r", "64", "--save_strategy", "steps", "--save_steps", "4"]
    full = launch_train("cpu/single.yaml", tmp_path / "full", flags)
    assert full.returncode == 0, full.output[-6000:]
    state = load_file(str(tmp_path / "full" / "checkpoint-4" / "optimizer.safetensors"))
    assert any(key.endswith("state1") and value.dtype == torch.uint8 for key, value in state.items())

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", resumed_dir / "checkpoint-4")
    resumed = launch_train("cpu/single.yaml", resumed_dir, [*flags, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-6000:]
    a, b = full.record["training"]["losses"], resumed.record["training"]["losses"]
    for step in range(4, 8):
        assert abs(a[step] - b[step]) <= RELATIVE_TOLERANCE * abs(a[step]), (step + 1, a, b)
