"""The recipe end to end through the real `accelerate launch`: LoRA and QLoRA, one process and FSDP1/FSDP2 on 2 ranks.

Each run asserts what a user relies on: the run really was what the config says (FSDP-wrapped, not silently DDP),
the loss went down, frozen base weights stayed bit-identical while LoRA weights moved, the saved adapter passed the
completeness check, and it loads with `PeftModel.from_pretrained` and changes the model's output.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.helpers import RELATIVE_TOLERANCE, launch_train
from tests.shared_runs import SECRET_TOKEN, SHARED_LAUNCHES

# shared run (tests/shared_runs.py: launch, data format, chat format, flags) -> expected wrapping
SCENARIOS = {
    "lora-single": ("NO", None),
    "lora-fsdp1": ("FSDP", 1),
    "lora-fsdp2": ("FSDP", 2),
    "qlora-single": ("NO", None),
    "qlora-fsdp1": ("FSDP", 1),
    "qlora-fsdp2": ("FSDP", 2),
    "dora-single": ("NO", None),
    "dora-fsdp1": ("FSDP", 1),
    "dora-fsdp2": ("FSDP", 2),
    "qdora-single": ("NO", None),
}


def _mean(values):
    return sum(values) / len(values)


def _logits_base_vs_adapter(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if len(tokenizer) != base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    ids = tokenizer("### User:\nWhat is the opposite of hot?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base_logits = base(ids).logits.clone()
        model = PeftModel.from_pretrained(base, adapter_dir)
        adapted = model(ids).logits
    return base_logits, adapted


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_train_save_verify_reload(name, tiny, shared_run):
    distributed_type, fsdp_version = SCENARIOS[name]
    launch = SHARED_LAUNCHES[name]
    chat_format, use_dora = launch.flag("--chat_template_format"), launch.flag("--use_dora") == "True"
    result = shared_run(name)  # launched with HF_TOKEN set: a logged-in user, whose token must leak into nothing
    out = result.output_dir
    assert result.returncode == 0, result.output[-6000:]
    assert "could not run" not in result.output  # every pre-load check ran (sft_recipe.errors.check_not_run)
    facts = result.record
    # A run that quantizes nothing never imports bitsandbytes (sft_recipe/compat/unused_imports.py); QLoRA does.
    # what the run cannot use stays out of its processes: bitsandbytes without quantization, wandb and mlflow
    # without W&B or MLflow, DeepSpeed off a DeepSpeed launch (tests/test_deepspeed.py: a ZeRO-3 run keeps it)
    assert facts["run"]["skipped_imports"] == (["wandb", "mlflow", "deepspeed"] if name.startswith("q") else
                                               ["bitsandbytes", "wandb", "mlflow", "deepspeed"])
    # The libraries imported without the cyclic collector, and what they made is never walked again
    # (sft_recipe/startup.py): torch, transformers, PEFT, TRL and datasets leave more than 300,000 objects.
    assert facts["run"]["imports_frozen"] is True

    # It ran the way the config says, and FSDP really wrapped the model (accelerate can silently run DDP on CPU).
    how = facts["distribution"]
    assert how["distributed_type"] == distributed_type and how["fsdp_version"] == fsdp_version
    if fsdp_version == 1:
        assert how["wrapped_class"] == "FullyShardedDataParallel" and how["num_processes"] == 2
        # PEFT's auto-wrap policy (applied by transformers) keeps LoRA and frozen weights in separate flat params.
        assert how["fsdp1_flat_params"]["trainable"] > 0 and how["fsdp1_flat_params"]["frozen"] > 0
    elif fsdp_version == 2:
        assert facts["distribution"]["wrapped_class"].startswith("FSDP") and facts["distribution"]["dtensor_params"] > 0
        assert facts["distribution"]["num_processes"] == 2
    else:
        assert facts["distribution"]["num_processes"] == 1 and facts["distribution"]["fsdp_modules"] == 0
    # The data was prepared by one process (rank 0); the other rank read its copy in the datasets cache.
    ranks = list(range(facts["distribution"]["num_processes"]))
    assert facts["data"]["prepared_on_ranks"] == [0] and facts["data"]["read_copy_on_ranks"] == ranks[1:]

    # Learning happened, to the right weights.
    losses = facts["training"]["losses"]
    assert len(losses) == 8 and _mean(losses[-2:]) < _mean(losses[:2]) - 0.05, losses
    assert facts["weights"]["frozen_changed"] is False and facts["weights"]["trainable_changed"] is True
    assert "frozen weights unchanged, trainable weights moved" in result.output  # the run summary line

    # Memory facts per rank: model state (shards under FSDP) and resident memory once the model was loaded.
    assert len(facts["memory"]["model_state_mib_per_rank"]) == facts["distribution"]["num_processes"]
    assert all(v > 0 for v in facts["memory"]["model_state_mib_per_rank"])
    assert all(v > 50 for v in facts["memory"]["rss_anon_after_load_mib_per_rank"])  # torch + transformers alone

    # Live throughput and memory in every training log, the end-of-run summary and plot, one progress bar.
    assert facts["training"]["global_steps"] == 8 and len(facts["training"]["losses"]) == 8
    assert facts["throughput"]["tokens_per_second"] > 0
    assert len(facts["memory"]["peak_memory_gib_per_rank"]) == facts["distribution"]["num_processes"]
    assert all(0.2 < gib < 8 for gib in facts["memory"]["peak_memory_gib_per_rank"])  # RSS of a tiny-model CPU run
    assert facts["run"]["config"]["model"]["lora_r"] == 8 and facts["throughput"]["flops_per_token"] > 0
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.output.count("'tokens_per_second': ") == 8
    assert result.output.count("0/8 [") == 1, "one training progress bar, not one per rank"

    # The adapter is complete (checked in the run) and loads the way users load it.
    assert "adapter check OK" in result.output
    assert not (out / "_adapter-FAILED-CHECK").exists()
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["peft_type"] == "LORA"
    assert saved["use_dora"] == use_dora
    if saved["use_dora"]:  # the learned magnitudes are part of the checked, reloaded adapter
        with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
            assert any("lora_magnitude_vector" in key for key in f.keys())
    base_logits, adapted = _logits_base_vs_adapter(tiny.model_dir, out)
    assert not torch.allclose(base_logits, adapted, atol=1e-4)
    if chat_format != "none":  # tokens were added: the standard loader must still work, with no extra code
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoTokenizer

        loaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
        assert loaded.get_input_embeddings().weight.shape[0] == len(AutoTokenizer.from_pretrained(str(out)))
    assert SECRET_TOKEN not in result.output
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET_TOKEN.encode() not in path.read_bytes(), path
    assert not list(out.rglob("*.bin")) and not list(out.rglob("*.pt"))  # only safetensors/json (no pickles)
    if fsdp_version == 1:  # the peft 0.21 FSDP1 key bug is worked around, and we can see whether it is still needed
        assert "adapter keys needed the FSDP1 name fix" in result.output


def test_checkpoint_adapters_are_verified_too(tiny, shared_run, tmp_path):
    """Every save that writes adapter files goes through the same checked save as the final adapter."""
    from sft_recipe.artifacts.adapter import check_adapter

    result = shared_run("lora-single")  # a checkpoint every 4 of its 8 steps
    out = result.output_dir
    assert result.returncode == 0, result.output[-6000:]
    for step in (4, 8):
        checkpoint = out / f"checkpoint-{step}"
        assert f"adapter check OK: {checkpoint}:" in result.output
        assert check_adapter(str(checkpoint)).ok
        # Resume state without pickles: safetensors + JSON only.
        assert {"optimizer.safetensors", "scheduler.json", "rng_state.safetensors"} <= {p.name for p in
                                                                                         checkpoint.iterdir()}
        assert not [p for p in checkpoint.iterdir() if p.suffix in (".pt", ".pth", ".bin", ".pkl")]

    # One-process resume from those files continues exactly (FSDP resumes: tests/e2e/test_resume.py).
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(out / "checkpoint-4", resumed_dir / "checkpoint-4")
    launch = SHARED_LAUNCHES["lora-single"]
    resumed = launch_train(launch.config, resumed_dir, [*launch.train_args(tiny), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-6000:]
    a, b = result.record["training"]["losses"], resumed.record["training"]["losses"]
    for step in range(4, 8):
        assert abs(a[step] - b[step]) <= RELATIVE_TOLERANCE * abs(a[step]), (step + 1, a, b)
