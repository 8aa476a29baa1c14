"""The model families people fine-tune, through the real launcher: each cell trains with the guide's LoRA flags
(all-linear, r 8, dropout 0.1, chatml), saves a verified adapter that AutoPeftModelForCausalLM loads, and merges.

Tiny random models from each family's own config class (sft_recipe.tiny.families). The cells are the ones whose code
paths differ (the full product family x engine would cost ~15 minutes):
- tied input/output embeddings (Qwen2) on every engine: FSDP2 with cpu_ram_efficient_loading (ranks > 0 build on the
  meta device: the tie must survive), FSDP1 and ZeRO-3 (the adapter-only gather must find the tied head), and one
  process as the reference the sharded adapters must equal; QLoRA on FSDP2; resume on FSDP1 and FSDP2; the tied
  pair trained in full (modules_to_save) stays one tensor (FSDP2 with efficient loading refuses it up front:
  tests/unit/test_architecture.py; with efficient loading off it trains, checked by hand);
- Llama-3.2's shape (tied, head_dim != hidden/heads) on FSDP2;
- Gemma-2 (eager attention, soft-capping: transformers' choice, said in the log) on FSDP2;
- a multimodal checkpoint trained on text (Gemma-3 with a vision tower, text config nested) on FSDP2: only the
  language model is adapted, its wrap classes exist, and its resized vocabulary is saved;
- fused MoE experts: Mixtral 4-bit on FSDP1 with the guide's dropout (attention adapted; its router an nn.Linear);
  DeepSeek-V3 (dense first layer, shared expert, a router that is no nn.Linear and holds a persistent buffer) on
  every engine: the guide's flags on FSDP1 (also as QLoRA: its fp32 router beside the bf16-stored base is an FSDP1
  unit of its own) and ZeRO-3 (with the chat format's new token rows trained), the experts named
  (--lora_target_parameters, dropout 0) in one process and on FSDP2 with efficient loading, whose adapter must
  equal the one-process adapter (a rank that loaded the router's bias wrong routes otherwise);
- non-Llama layouts: GPT-NeoX on FSDP1, Phi-3 (fused qkv/gate_up) in one process;
- an adapter trained further (--adapter_name_or_path; the Llama demo's on every engine: test_adapter_trained_further):
  the tied Qwen2's on FSDP1, FSDP2 and ZeRO-3, Mixtral's on FSDP1 and FSDP2, DeepSeek-V3's on ZeRO-3, Gemma-2's onto
  its 4-bit base on FSDP1 (FURTHER below).
Dropped as duplicates of the paths above: Qwen3-MoE with named experts (the DeepSeek cells
run the same paths), Mistral, Qwen3 and Gemma-3 text (Llama/Qwen2-shaped decoder layers; their
one-process runs were checked by hand), and the families' one-process runs whose FSDP cell runs here.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import QLORA_FLAGS, RELATIVE_TOLERANCE, launch_env, launch_train

GUIDE = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
         "--lora_target_modules", "all-linear", "--chat_template_format", "chatml", "--max_seq_len", "64",
         "--per_device_train_batch_size", "2", "--logging_steps", "1", "--learning_rate", "3e-3", "--packing", "True",
         "--report_to", "none", "--eval_strategy", "no", "--seed", "7", "--bf16", "False"]
STEPS = ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2"]
NO_DROPOUT = ["--lora_dropout", "0.0"]  # where adapters are compared across engines: dropout masks differ per rank
EXPERTS = [*NO_DROPOUT, "--lora_target_parameters", "experts.gate_up_proj,experts.down_proj"]
CONFIGS = {"single": "cpu/single.yaml", "fsdp1": "cpu/fsdp_config.yaml", "fsdp2": "cpu/fsdp2_config.yaml",
           "zero3": "cpu/deepspeed_config.yaml"}

# cell -> (family, engine, extra flags)
CELLS = {
    "qwen2-single": ("qwen2", "single", [*NO_DROPOUT, "--per_device_train_batch_size", "4"]),
    "qwen2-fsdp2": ("qwen2", "fsdp2", NO_DROPOUT),
    "qwen2-fsdp1": ("qwen2", "fsdp1", NO_DROPOUT),
    "qwen2-zero3": ("qwen2", "zero3", [*NO_DROPOUT, "--ddp_backend", "gloo"]),
    "qwen2-qlora-fsdp2": ("qwen2", "fsdp2", QLORA_FLAGS),
    "qwen2-embeddings-single": ("qwen2", "single", ["--lora_modules_to_save", "embed_tokens,lm_head"]),
    "llama-tied-fsdp2": ("llama-tied", "fsdp2", []),
    "gemma2-fsdp2": ("gemma2", "fsdp2", []),
    "gemma3-multimodal-fsdp2": ("gemma3-multimodal", "fsdp2", []),
    # The 4-bit base loaded on the CPU and wrapped (issue 16), and the bf16 LoRA base (issue 19), off the Llama demo.
    "mixtral-qlora-fsdp1": ("mixtral", "fsdp1", QLORA_FLAGS),
    # the start of the Mixtral adapter trained further (FURTHER): a 16-bit adapter (one trained over a 4-bit base
    # keeps the resized vocabulary's rows in bf16)
    "mixtral-fsdp1": ("mixtral", "fsdp1", []),
    # An fp32 router (transformers keeps it so) beside the bf16-stored 4-bit base: its own FSDP1 unit
    # (compat.wrap_other_dtypes_apart); without it FSDP1 refused to flatten the layer's mixed dtypes.
    "deepseek-v3-qlora-fsdp1": ("deepseek-v3", "fsdp1", QLORA_FLAGS),
    "qwen2-bf16-base-fsdp1": ("qwen2", "fsdp1", ["--bf16", "True", "--use_reentrant", "True"]),
    "deepseek-v3-experts-single": ("deepseek-v3", "single", [*EXPERTS, "--per_device_train_batch_size", "4"]),
    "deepseek-v3-experts-fsdp2": ("deepseek-v3", "fsdp2", EXPERTS),
    "deepseek-v3-fsdp1": ("deepseek-v3", "fsdp1", []),
    # with the chat format's new rows trained (PEFT's trainable tokens through ZeRO-3's gathers), off the Llama demo
    "deepseek-v3-zero3": ("deepseek-v3", "zero3", ["--ddp_backend", "gloo", "--train_new_tokens", "True"]),
    "gpt-neox-fsdp1": ("gpt-neox", "fsdp1", []),
    "phi3-single": ("phi3", "single", []),
}


# --adapter_name_or_path off the Llama demo, on the engines whose loading differs: cell -> (the cell whose final
# adapter it trains further, engine, extra flags). One step at rate 0 (the first of a warmup), so the adapter saved
# must be the one loaded, and the first loss the trained adapter's on the start cell's first batch (same global
# batch, seed and data). The tied pair on FSDP1 (the head found through the tie when the adapter loads and when it
# is gathered); MoE experts and router under ZeRO-3 (the adapter loaded before DeepSpeed partitions); Gemma's
# adapter onto its 4-bit base under FSDP1 (QLoRA continuing an adapter trained on the 16-bit base).
FURTHER = {
    "qwen2-further-fsdp1": ("qwen2-single", "fsdp1", NO_DROPOUT),
    "deepseek-v3-further-zero3": ("deepseek-v3-fsdp1", "zero3", ["--ddp_backend", "gloo"]),
    "gemma2-further-qlora-fsdp1": ("gemma2-fsdp2", "fsdp1", QLORA_FLAGS),
    # Issue 52: the tied pair on FSDP2 (efficient loading: ranks > 0 build on meta, then receive the adapter) and
    # ZeRO-3 (loaded before DeepSpeed partitions it); a Mixtral-style MoE (linear router, fused experts) on both FSDPs.
    "qwen2-further-fsdp2": ("qwen2-single", "fsdp2", NO_DROPOUT),
    "qwen2-further-zero3": ("qwen2-single", "zero3", [*NO_DROPOUT, "--ddp_backend", "gloo"]),
    "mixtral-further-fsdp1": ("mixtral-fsdp1", "fsdp1", []),
    "mixtral-further-fsdp2": ("mixtral-fsdp1", "fsdp2", []),
}
ONE_STEP_AT_RATE_0 = ["--warmup_steps", "5", "--max_steps", "1", "--save_strategy", "no"]


@pytest.fixture(scope="module")
def runs(family_model, tiny, tmp_path_factory):
    results = {}

    def launch(cell, family, engine, flags):
        env = launch_env(cpu_switch=engine != "zero3")  # DeepSpeed on CPU: gloo, without the CPU switch
        results[cell] = launch_train(CONFIGS[engine], tmp_path_factory.mktemp(cell), [
            "--model_name_or_path", str(family_model(family)), "--dataset_name", str(tiny.jsonl_dir), *GUIDE, *STEPS,
            *flags], env=env)

    for cell, (family, engine, extra) in CELLS.items():
        launch(cell, family, engine, extra)
    for cell, (start, engine, extra) in FURTHER.items():
        launch(cell, CELLS[start][0], engine, [*extra, "--adapter_name_or_path", str(results[start].output_dir),
                                               *ONE_STEP_AT_RATE_0])
    return results


@pytest.mark.parametrize("cell", list(CELLS))
def test_each_family_trains_saves_a_verified_adapter_that_loads_and_merges(runs, cell, tmp_path):
    from peft import AutoPeftModelForCausalLM

    from sft_recipe.merge import merge_adapter

    result = runs[cell]
    assert result.returncode == 0, result.output[-5000:]
    assert "adapter check OK" in result.output
    assert "Traceback" not in result.output
    losses = result.record["training"]["losses"]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert result.record["weights"]["frozen_changed"] is False and result.record["weights"]["trainable_changed"]
    assert not (result.output_dir / "loss_curve.png").exists()  # --plot_loss_curve False (tests.helpers.launch_train)
    model = AutoPeftModelForCausalLM.from_pretrained(str(result.output_dir))
    saved = load_file(str(result.output_dir / "adapter_model.safetensors"))
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert sum(".lora_" in k for k in saved) == len(loaded) > 0
    merged = merge_adapter(str(result.output_dir), str(tmp_path / "merged"), log=lambda *a: None)
    assert "check OK" in merged.summary()


def test_a_quantized_moe_and_a_tied_bf16_base_load_as_planned(runs, family_model):
    qlora = runs["mixtral-qlora-fsdp1"]
    assert "quantized base loaded on the CPU for FSDP" in qlora.output  # compat.quantized_base_device_map
    bf16 = runs["qwen2-bf16-base-fsdp1"].record
    assert bf16["run"]["config"]["model"]["torch_dtype"] == "bfloat16"  # the default under --bf16 True
    fp32 = runs["qwen2-fsdp1"].record  # the same model loaded in fp32 (--bf16 False)
    from sft_recipe.plan import model_shape

    # chatml grew the vocabulary by 3 rows; the tied head counts once
    halved = model_shape(str(family_model("qwen2")), extra_vocab=3).total_params * 2 / 2 ** 20
    saved = fp32["memory"]["weight_mib_after_load_per_rank"][0] - bf16["memory"]["weight_mib_after_load_per_rank"][0]
    assert saved == pytest.approx(halved, rel=0.05)


def test_attention_is_the_families_own_and_said_once(runs):
    assert "attention: eager for Gemma2ForCausalLM" in runs["gemma2-fsdp2"].output
    assert "attention: sdpa for LlamaForCausalLM" in runs["llama-tied-fsdp2"].output
    assert runs["gemma2-fsdp2"].output.count("attention: eager") == 1  # the main process says it


@pytest.mark.parametrize("cell", ["qwen2-fsdp2", "qwen2-fsdp1", "qwen2-zero3"])
def test_a_tied_models_sharded_adapter_is_the_one_process_adapter(runs, cell):
    """Same seed and global batch (4 rows a step: one process x 4, 2 ranks x 2), no dropout: the sharded save holds
    what PEFT's own unsharded save holds -- the tied head's key included -- with the same values."""
    single = load_file(str(runs["qwen2-single"].output_dir / "adapter_model.safetensors"))
    sharded = load_file(str(runs[cell].output_dir / "adapter_model.safetensors"))
    assert sharded.keys() == single.keys()
    assert {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"} <= set(single)
    head, embedding = "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"
    assert torch.equal(sharded[head], sharded[embedding])  # still one tensor under two names
    for key, tensor in sharded.items():
        torch.testing.assert_close(tensor, single[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_tied_embedding_trained_in_full_is_saved_as_one_tensor(runs, family_model):
    result = runs["qwen2-embeddings-single"]
    assert result.returncode == 0, result.output[-5000:]
    saved = load_file(str(result.output_dir / "adapter_model.safetensors"))
    # PEFT saves a modules_to_save copy under the module's own name
    head, embedding = saved["base_model.model.lm_head.weight"], saved["base_model.model.model.embed_tokens.weight"]
    assert torch.equal(head, embedding)  # trained, and still tied (PEFT's ensure_weight_tying)
    base = load_file(str(family_model("qwen2") / "model.safetensors"))["model.embed_tokens.weight"]
    assert not torch.equal(embedding[: base.shape[0]], base)  # trained: it moved from the base's rows


@pytest.mark.parametrize("cell", ["mixtral-qlora-fsdp1", "deepseek-v3-fsdp1", "deepseek-v3-zero3"])
def test_moe_adapts_attention_by_default_and_says_what_all_linear_leaves_out(runs, cell):
    default = load_file(str(runs[cell].output_dir / "adapter_model.safetensors"))
    assert default and not any(".mlp." in k for k in default)  # neither experts nor router under all-linear
    assert any(".self_attn." in k for k in default)
    said = "all-linear leaves 6 linears untrained (down_proj, gate_proj, up_proj"  # DeepSeek's dense + shared MLPs
    assert (said in runs[cell].output) == cell.startswith("deepseek")


def test_an_moes_new_token_rows_train_under_zero3(runs, family_model, tmp_path):
    """--train_new_tokens under DeepSpeed ZeRO-3 on DeepSeek-V3 (MoE, untied head): the chatml rows of the embedding
    and the head moved, are saved with the adapter, and reload as trained."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoConfig, AutoTokenizer

    result = runs["deepseek-v3-zero3"]
    assert result.returncode == 0, result.output[-5000:]
    assert "keep random embedding" not in result.output
    out = result.output_dir
    ids = list(range(AutoConfig.from_pretrained(str(family_model("deepseek-v3"))).vocab_size,
                     len(AutoTokenizer.from_pretrained(str(out)))))
    assert len(ids) == 3  # <|im_start|>, <|im_end|>, <pad>
    saved = load_file(str(out / "adapter_model.safetensors"))
    rows = {}
    for key in ("model.embed_tokens", "lm_head"):
        delta = saved[f"base_model.model.{key}.token_adapter.trainable_tokens_delta"]
        start = saved[f"base_model.model.{key}.token_adapter.base_layer.weight"][ids]
        assert delta.shape == start.shape and (delta - start).abs().max() > 1e-3, f"{key}: the new rows did not move"
        rows[key] = delta
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        torch.testing.assert_close(loaded.get_input_embeddings()(torch.tensor(ids)), rows["model.embed_tokens"])


def test_named_experts_train_on_fsdp2_as_in_one_process_and_the_router_never(runs):
    """Same seed and global batch, no dropout: the FSDP2 adapter (ranks > 0 built on the meta device, weights and the
    router's persistent bias broadcast from rank 0: compat.load_persistent_buffers_apart) is the one-process one."""
    single = load_file(str(runs["deepseek-v3-experts-single"].output_dir / "adapter_model.safetensors"))
    sharded = load_file(str(runs["deepseek-v3-experts-fsdp2"].output_dir / "adapter_model.safetensors"))
    assert any(".mlp.experts." in k and "lora_" in k for k in single)
    assert not any(".gate." in k or "shared_experts" in k for k in single)  # the router stays untouched
    assert sharded.keys() == single.keys()
    for key, tensor in sharded.items():
        torch.testing.assert_close(tensor, single[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_multimodal_checkpoint_adapts_its_language_model_and_keeps_its_resized_vocabulary(runs):
    saved = load_file(str(runs["gemma3-multimodal-fsdp2"].output_dir / "adapter_model.safetensors"))
    lora = [k for k in saved if ".lora_" in k]
    assert lora and all("language_model" in k for k in lora)
    rows = {k: v.shape[0] for k, v in saved.items() if ".lora_" not in k}
    assert rows and set(rows.values()) == {555}  # 552 + chatml's 3 tokens: the rows the adapter was trained with


@pytest.mark.parametrize("cell", ["qwen2-fsdp2", "qwen2-fsdp1"])
def test_a_tied_model_resumes_from_its_checkpoint_to_the_same_adapter(runs, cell, family_model, tiny, tmp_path):
    full = runs[cell]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full.output_dir / "checkpoint-2", resumed_dir / "checkpoint-2")
    family, engine, extra = CELLS[cell]
    resumed = launch_train(CONFIGS[engine], resumed_dir, ["--model_name_or_path", str(family_model(family)),
                                                          "--dataset_name", str(tiny.jsonl_dir), *GUIDE, *STEPS,
                                                          *extra, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-5000:]
    a, b = full.record["training"]["losses"], resumed.record["training"]["losses"]
    for step in (2, 3):  # steps 3 and 4 ran after the resume
        assert abs(a[step] - b[step]) <= RELATIVE_TOLERANCE * abs(a[step]), (step + 1, a, b)
    final_a = load_file(str(full.output_dir / "adapter_model.safetensors"))
    final_b = load_file(str(resumed_dir / "adapter_model.safetensors"))
    assert final_a.keys() == final_b.keys()
    for key in final_a:
        torch.testing.assert_close(final_b[key], final_a[key], rtol=RELATIVE_TOLERANCE, atol=1e-6, msg=key)


def test_zero3_resumes_exactly_and_follows_a_changed_weight_decay_and_beta2(runs, family_model, tiny, tmp_path):
    """DeepSpeed restores its optimizer, hyperparameters included, before the Trainer's hook: the resume takes this
    launch's weight decay and beta2 from the optimizer the Trainer built (sft_recipe/train/resume_settings.py)."""
    full = runs["qwen2-zero3"]
    assert full.returncode == 0, full.output[-5000:]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full.output_dir / "checkpoint-2", resumed_dir / "checkpoint-2")
    family, engine, extra = CELLS["qwen2-zero3"]
    resumed = launch_train(CONFIGS[engine], resumed_dir, [
        "--model_name_or_path", str(family_model(family)), "--dataset_name", str(tiny.jsonl_dir), *GUIDE, *STEPS,
        *extra, "--resume_from_checkpoint", "latest", "--weight_decay", "0.5", "--adam_beta2", "0.9"],
        env=launch_env(cpu_switch=False))
    assert resumed.returncode == 0, resumed.output[-5000:]
    said = "--weight_decay 0 -> 0.5, --adam_beta1/--adam_beta2 (0.9, 0.999) -> (0.9, 0.9)"
    assert f"this launch's settings replace the checkpoint's: {said}" in resumed.output
    assert "stay as saved" not in resumed.output
    a, b = full.record["training"]["losses"], resumed.record["training"]["losses"]
    # Step 3's loss is the checkpoint's weights on the same batch: the resume is exact up to there.
    assert abs(a[2] - b[2]) <= RELATIVE_TOLERANCE * abs(a[2]), (a, b)
    # Steps 3 and 4 updated with the new settings: the adapter differs from the run that kept the old ones, by far
    # more than the 1e-5 two identical ZeRO-3 runs differ by (test_parity.py, tests/test_deepspeed.py).
    final_a = load_file(str(full.output_dir / "adapter_model.safetensors"))
    final_b = load_file(str(resumed_dir / "adapter_model.safetensors"))
    assert final_a.keys() == final_b.keys()
    worst = max(float((final_b[k] - final_a[k]).abs().max() / final_a[k].abs().max().clamp_min(1e-12))
                for k in final_a if ".lora_B" in k)
    assert worst > 1e-3, worst


@pytest.mark.parametrize("cell", list(FURTHER))
def test_a_familys_adapter_trained_further_starts_from_its_weights(runs, cell):
    start = runs[FURTHER[cell][0]]
    result = runs[cell]
    assert result.returncode == 0, result.output[-5000:]
    assert f"LoRA: training the adapter at {start.output_dir} further" in result.output
    assert "adapter check OK" in result.output
    assert result.record["run"]["quantization"] == ("4bit" if "qlora" in cell else None)
    before = load_file(str(start.output_dir / "adapter_model.safetensors"))
    after = load_file(str(result.output_dir / "adapter_model.safetensors"))
    assert before.keys() == after.keys()
    # Over a 4-bit base TRL casts the adapter to bf16 (the guide's QLoRA computes with it), and the resized
    # vocabulary's rows sit in the bf16 base: the fp32 adapter trained further there is itself, rounded to bf16.
    trained_in = torch.bfloat16 if "qlora" in cell else torch.float32
    for key in before:  # every LoRA matrix, the tied pair, the resized rows: loaded, wrapped, gathered as loaded
        assert before[key].dtype == torch.float32, key
        assert torch.equal(before[key].to(trained_in), after[key].to(trained_in)), key
    first, fresh_first = result.record["training"]["losses"][0], start.record["training"]["losses"][0]
    assert first < fresh_first - 100 * RELATIVE_TOLERANCE * fresh_first, (first, fresh_first)
