"""The guide's two runs (PEFT's "Use PEFT and FSDP", Llama-2-70B), planned offline and set beside its published
figures: `python -m sft_recipe.plan --guide`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sft_recipe.plan.gpu import UPSTREAM_SAVE_ROW
from sft_recipe.plan.inputs import parse_train_flags, read_accelerate_config
from sft_recipe.plan.planner import plan_memory
from sft_recipe.plan.result import GIB, GPU_PLAN_ERROR_BELOW, MemoryPlan

# The guide's published per-GPU figures (GiB as nvidia-smi shows them) for its two runs.
PUBLISHED = {
    "lora-8x80": {"gpu_gib": (72.0, 80.0), "what": "LoRA r=8 all-linear, 8x80 GB, FULL_SHARD, bf16, seq 2048"},
    "qlora-2x24-offload": {"gpu_gib": (19.6, 19.6), "host_gib": 107.0,
                           "what": "QLoRA, 2x24 GB, FULL_SHARD + CPU offload"},
    "qlora-2x24": {"gpu_gib": (35.6, 35.6), "what": "QLoRA, 2x24 GB, FULL_SHARD, no offload"},
}

# The guide's runs as the recipe's shipped files state them, held here so that the comparison runs from an installed
# package as from a checkout. Only the keys the planner reads: the recipes' logging, Hub and optimizer-schedule keys
# size no memory. tests/unit/test_plan.py holds every value equal to recipes/llama2_70b_lora.yaml,
# recipes/llama2_70b_qlora.yaml, configs/fsdp_config.yaml and configs/fsdp_config_qlora.yaml, key by key.
LORA_RECIPE: dict[str, Any] = {
    "model_name_or_path": "meta-llama/Llama-2-70b-hf",  # its architecture ships in sft_recipe/plan/models
    "chat_template_format": "chatml",
    "max_seq_len": 2048,
    "bf16": True,
    "torch_dtype": "bfloat16",
    "packing": True,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 4,
    "gradient_checkpointing": True,
    "use_reentrant": False,  # sizes nothing but --activation_offloading's host RAM (renting.py)
    "use_flash_attn": True,
    "use_peft_lora": True,
    "lora_r": 8,
    "lora_dropout": 0.1,
    "lora_target_modules": "all-linear",
    "use_4bit_quantization": False,
}
QLORA_RECIPE: dict[str, Any] = {
    **{key: value for key, value in LORA_RECIPE.items() if key != "torch_dtype"},  # 4-bit: its storage dtype
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "use_reentrant": True,
    "use_4bit_quantization": True,
    "use_nested_quant": True,
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage_dtype": "bfloat16",
}
FSDP_8_GPUS: dict[str, Any] = {  # configs/fsdp_config.yaml
    "distributed_type": "FSDP",
    "num_machines": 1,
    "num_processes": 8,
    "mixed_precision": "bf16",
    "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": False,
                    "fsdp_cpu_ram_efficient_loading": True},
}
FSDP_2_GPUS_OFFLOAD: dict[str, Any] = {  # configs/fsdp_config_qlora.yaml
    "distributed_type": "FSDP",
    "num_machines": 1,
    "num_processes": 2,
    "mixed_precision": "no",
    "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": True,
                    "fsdp_cpu_ram_efficient_loading": True},
}


@dataclass(frozen=True)
class GuideRun:
    """One of the guide's runs: what it trains, how it is spread, and the GPUs it ran on."""

    recipe: dict[str, Any]  # train.py flags, keyed as the recipe YAML names them
    accelerate_config: dict[str, Any]
    gpu_memory_gib: float


def _without_offload(accelerate_config: dict[str, Any]) -> dict[str, Any]:
    return {**accelerate_config, "fsdp_config": {**accelerate_config["fsdp_config"], "fsdp_offload_params": False}}


GUIDE_RUNS = {
    "lora-8x80": GuideRun(LORA_RECIPE, FSDP_8_GPUS, 80.0),
    "qlora-2x24-offload": GuideRun(QLORA_RECIPE, FSDP_2_GPUS_OFFLOAD, 24.0),
    "qlora-2x24": GuideRun(QLORA_RECIPE, _without_offload(FSDP_2_GPUS_OFFLOAD), 24.0),
}


def recipe_flags(recipe: dict[str, Any]) -> list[str]:
    """The train.py command line that says what a recipe YAML says: `--key value` per key."""
    return [token for key, value in recipe.items() for token in (f"--{key}", str(value))]


UPSTREAM_LORA_DTYPE = "float32"  # upstream's train.py loads a LoRA base in fp32 (and the guide's figures are of it)
# The guide's stack (transformers 4.4x) upcast the full logits to fp32 in the model's forward for the loss
# (components.LOSS_IMPLS); its trainer dropped the output before backward, so they were not kept.
GUIDE_LOSS_IMPL = "full-logits"


def guide_plans(load_path: str = "recipe", lora_dtype: str | None = None,
                loss_impl: str = "trl-chunked") -> dict[str, MemoryPlan]:
    """The guide's two runs (QLoRA with and without offload) planned offline from GUIDE_RUNS (the recipes name
    meta-llama/Llama-2-70b-hf, whose architecture ships in sft_recipe/plan/models/llama-2-70b). `load_path`
    "upstream": the quantized base loaded where transformers 5.x puts it without the recipe's placement;
    `lora_dtype`: the LoRA base's dtype instead of the recipe's default (UPSTREAM_LORA_DTYPE: as upstream loads it);
    `loss_impl`: the loss as the guide's stack computed it (GUIDE_LOSS_IMPL) instead of TRL 1.16's chunked head."""
    plans = {}
    for key, run in GUIDE_RUNS.items():
        recipe = dict(run.recipe)
        if lora_dtype and not recipe.get("use_4bit_quantization"):
            recipe["torch_dtype"] = lora_dtype
        model_args, data_args, _, training_args = parse_train_flags(recipe_flags(recipe), "cuda")
        cfg = read_accelerate_config(run.accelerate_config)
        plans[key] = plan_memory(model_args, data_args, training_args, cfg, None, run.gpu_memory_gib, "cuda",
                                 ladder=False, load_path=load_path, loss_impl=loss_impl)
    return plans


def render_load_comparison(plans: dict[str, MemoryPlan], upstream: dict[str, MemoryPlan]) -> list[str]:
    """The QLoRA runs' load phase, the recipe's path beside upstream's on transformers 5.x: GPU per rank at the end
    of from_pretrained and through wrapping, the largest phase and the verdict it gives."""
    lines = ["  loading the 4-bit base on transformers 5.x (GiB per GPU: after from_pretrained / through wrapping; "
             "the verdict names the first phase that does not fit):"]
    for key in (k for k in plans if GUIDE_RUNS[k].recipe.get("use_4bit_quantization")):
        for path, plan in (("recipe", plans[key]), ("upstream", upstream[key])):
            verdict = plan.verdict if plan.verdict != "does not fit" else \
                f"does not fit at {plan.fails_at or plan.largest_phase}"
            lines.append(f"    {key:<20}{path:<10}{plan.phases['load'] / GIB:>6.1f} / {plan.phases['wrap'] / GIB:<6.1f}"
                         f"  largest: {plan.largest_phase} {plan.peak_gib:.1f}  -> {verdict} in "
                         f"{plan.budget_gib:g} GiB")
    plan = plans["qlora-2x24-offload"]
    loading = {r.name: r for r in plan.host_rows}["loading"]
    lines.append(f"    recipe: the base loads on the CPU: {loading.formula} ({loading.bytes / GIB:.0f} GiB of host RAM "
                 f"per machine at load, each weight quantized on the loading rank's GPU: "
                 f"~{plan.quantization_seconds:.0f} s); "
                 "upstream: transformers 5.x quantizes it onto every GPU whole, before FSDP can shard it")
    return lines


def render_guide_comparison(plans: dict[str, MemoryPlan] | None = None,
                            upstream: dict[str, MemoryPlan] | None = None,
                            as_published: dict[str, MemoryPlan] | None = None) -> str:
    """`plans`: the recipe's (default dtype and placement); `upstream`: upstream's train.py on this stack (fp32 LoRA
    base, the quantizer's placement); `as_published`: the guide's own setup (fp32 LoRA base, a 4-bit base placed as
    transformers 4.4x did, which the recipe's placement reproduces), set beside the published figures."""
    plans = plans or guide_plans()
    upstream = upstream or guide_plans("upstream", UPSTREAM_LORA_DTYPE)
    as_published = as_published or guide_plans(lora_dtype=UPSTREAM_LORA_DTYPE, loss_impl=GUIDE_LOSS_IMPL)
    lines = ["The guide's runs (Llama-2-70B), predicted vs published (GiB per GPU, nvidia-smi):",
             f"  {'run':<22}{'predicted':>10}{'published':>12}{'ratio':>8}{'verdict':>14}{'this recipe':>13}"
             "   setup (this recipe)"]
    for key, plan in as_published.items():
        lo, hi = PUBLISHED[key]["gpu_gib"]
        pub = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
        lines.append(f"  {key:<22}{plan.peak_gib:>10.1f}{pub:>12}{plan.peak_gib / ((lo + hi) / 2):>7.2f}x"
                     f"{plan.verdict:>14}{plans[key].peak_gib:>13.1f}   {plans[key].setup}")
    lines.append(f"  (predicted: the guide's setup, a LoRA base in {UPSTREAM_LORA_DTYPE} as upstream loads it and the "
                 f"loss its stack computed ({GUIDE_LOSS_IMPL}); ratio: predicted / published (the middle of a range); "
                 "this recipe: its defaults, a bf16 base for LoRA under bf16 mixed precision, TRL's chunked loss)")
    lines.append(f"  the plan's error on GPUs: published figures came to at most {GPU_PLAN_ERROR_BELOW:.0%} above "
                 "their plans (tests/published_gpu_memory.csv, 22 figures: bench/plan_vs_published.py); 'fits' keeps "
                 "that much headroom, 'tight' is a peak inside it")
    lines += render_load_comparison(plans, upstream)
    host = plans["qlora-2x24-offload"].host_peak_bytes / GIB
    row = {r.name: r.bytes for r in upstream["qlora-2x24-offload"].host_rows}
    upstream_save = row.get("offloaded shards", 0) + row[UPSTREAM_SAVE_ROW]
    upstream_host = (row["runtime"] + max(row["loading"], upstream_save)) / GIB
    lines.append(f"  host RAM, QLoRA + offload: predicted {host:.0f} GiB here (runtime, the quantized base "
                 f"while loading, then offloaded shards and the adapter-only save); {upstream_host:.0f} GiB on "
                 f"upstream's path (its final FULL_STATE_DICT gather), published "
                 f"~{PUBLISHED['qlora-2x24-offload']['host_gib']:g} GB")
    for key in ("lora-8x80", "qlora-2x24-offload"):
        row = {r.name: r.bytes for r in plans[key].host_rows} if key in plans else {}
        theirs = {r.name: r.bytes for r in upstream[key].host_rows} if key in upstream else {}
        if row and theirs:
            lines.append(f"  final save, {key}: {row['final save (rank 0)'] / GIB:.2f} GiB of host RAM on rank 0 (the "
                         f"adapter, gathered then written) vs {theirs[UPSTREAM_SAVE_ROW] / GIB:.0f} GiB for upstream's "
                         "FULL_STATE_DICT gather of every weight")
    lines.append("  Gaps: host RAM figures also depend on the page cache the checkpoint reads fill (not counted in "
                 "the peak).")
    return "\n".join(lines)

