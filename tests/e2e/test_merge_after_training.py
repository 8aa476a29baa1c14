"""Merging real trained adapters with the command users run: `python merge_adapter.py` after training.

Two training runs, read from the shared launches (tests/shared_runs.py): LoRA under real FSDP1 on 2 CPU ranks
(chatml, so the vocabulary grew), and QLoRA in one process (4-bit base, bf16 storage). Each adapter is merged by a
plain subprocess; the merged folder is loaded with plain `AutoModelForCausalLM.from_pretrained` and its logits
compared with PeftModel(base, adapter).
Tolerances: fp32 1e-5 absolute (rounding only; measured ~3e-6 on these logits of magnitude ~6). bf16: 5e-2 of the
logit scale (merging rounds W + B@A to bf16 once while the reference adds the LoRA path at run time; measured ~1e-2),
and the merged model must be closer to base+adapter than to the base by at least 2x.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors import safe_open

from tests.helpers import REPO, free_port, launch_env, reference_and_merged_logits, run_command

FP32_ATOL = 1e-5
BF16_RELATIVE_TOLERANCE = 5e-2


def _merge(adapter_dir, output_dir, *extra):
    cmd = [sys.executable, "merge_adapter.py",
           "--adapter_dir", str(adapter_dir), "--output_dir", str(output_dir), *extra]
    return run_command(cmd, output_dir, env=launch_env(cpu_switch=False))  # a plain command: no launcher


def _check_ids(adapter_dir, base_rows):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir))
    added = list(range(base_rows, len(tokenizer)))  # rows the run added (chatml) must merge too
    return tokenizer, torch.tensor([tokenizer("### User:\nWhat is the opposite of hot?")["input_ids"] + added])


def test_fsdp1_lora_adapter_merges_after_training(tiny, shared_run, tmp_path):
    result = shared_run("lora-fsdp1")  # chatml: the merge must carry the rows the run added
    out, merged_dir = result.output_dir, tmp_path / "fsdp1-merged"
    assert result.returncode == 0, result.output[-6000:]
    how = result.record["distribution"]
    assert how["fsdp_version"] == 1 and how["wrapped_class"] == "FullyShardedDataParallel"

    # Under the launcher, with 2 ranks: refused before anything loads, with the plain command to run instead.
    refused = run_command([os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
                           str(REPO / "configs" / "cpu" / "fsdp_config.yaml"), "--main_process_port",
                           str(free_port()), "merge_adapter.py", "--adapter_dir", str(out), "--output_dir",
                           str(merged_dir)], merged_dir)
    assert refused.returncode != 0 and "WORLD_SIZE=2" in refused.output, refused.output[-3000:]
    assert "run it as a plain command after training" in refused.output and not merged_dir.exists()

    merged = _merge(out, merged_dir)
    assert merged.returncode == 0, merged.output[-4000:]
    print(merged.output.strip().splitlines()[-1])  # the summary line, shown with -s
    assert "check OK" in merged.output and "dtype float32" in merged.output  # the base config's dtype
    base_rows = json.loads((tiny.model_dir / "config.json").read_text())["vocab_size"]
    tokenizer, ids = _check_ids(out, base_rows)
    assert len(tokenizer) > base_rows  # chatml added tokens: the base had to be resized
    base_logits, reference, merged_logits, model = reference_and_merged_logits(out, merged_dir, ids)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) and model.dtype == torch.float32
    assert (merged_logits - reference).abs().max() < FP32_ATOL
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the trained adapter is in the merged weights
    eos = model.generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])


def test_qlora_adapter_merges_into_the_bf16_base(shared_run, tmp_path):
    result = shared_run("qlora-single")
    out, merged_dir = result.output_dir, tmp_path / "qlora-merged"
    assert result.returncode == 0, result.output[-6000:]
    assert result.record["run"]["quantization"] == "4bit"  # train.py records it; the merge reads it

    merged = _merge(out, merged_dir)  # no --dtype: the 4-bit training is detected from run_record.json
    assert merged.returncode == 0, merged.output[-4000:]
    print(merged.output.strip().splitlines()[-1])
    assert "dtype bfloat16" in merged.output and "QLoRA" in merged.output and "check OK" in merged.output
    config = json.loads((merged_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config  # the plain base, not 4-bit
    with safe_open(str(merged_dir / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    _, ids = _check_ids(out, config["vocab_size"])
    base_logits, reference, merged_logits, model = reference_and_merged_logits(out, merged_dir, ids,
                                                                                dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    diff = float((merged_logits - reference).abs().max())
    effect = float((reference - base_logits).abs().max())
    scale = max(1.0, float(reference.abs().max()))
    assert diff <= BF16_RELATIVE_TOLERANCE * scale, (diff, scale)
    assert diff < effect / 2, (diff, effect)  # closer to base+adapter than to the bare base
