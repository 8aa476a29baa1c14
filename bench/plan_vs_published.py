"""The memory plan beside every GPU figure others measured and published (tests/published_gpu_memory.csv).

    .venv/bin/python bench/plan_vs_published.py          # one line per published figure, then the summary

Each row of the table is planned as the source ran it (model, engine, GPUs, CPU offload, batch, sequence length, LoRA
rank, alpha and targets, checkpointing), from the architectures shipped in sft_recipe/plan/models. The figure's
kind decides what of the plan it is set against: "nvidia-smi" (the whole process on the GPU) the plan's peak;
"peak reserved" (torch.cuda.max_memory_reserved, no CUDA context) the peak without the framework-overhead row;
"peak allocated" without that row and the allocator's reserve. Ratio = plan / published: above 1 the plan is
pessimistic, below 1 it would say "fits" for a run that may not. DeepSpeed figures have no plan yet (printed as
such). Where the plan cannot say what the source ran, the row says so: the plan keeps LoRA weights in fp32 as this
recipe does (Answer.AI trained them in bf16) and computes today's chunked loss (those stacks held full fp32 logits).
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "published_gpu_memory.csv"
ANSWERAI_TARGETS = "q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj"


def read_table(path: Path = TABLE) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def published_gib(row: dict) -> float:
    """The figure in GiB; a range (the guide's 72-80) as its middle."""
    low, _, high = row["figure"].partition("-")
    return (float(low) + float(high or low)) / 2


def train_flags(row: dict) -> list[str]:
    qlora = row["method"] == "qlora"
    targets = "all-linear" if row["lora_targets"] == "all-linear" else ANSWERAI_TARGETS
    flags = ["--model_name_or_path", row["model"], "--use_peft_lora", "True", "--lora_r", row["lora_r"],
             "--lora_alpha", row["lora_alpha"], "--lora_target_modules", targets,
             "--per_device_train_batch_size", row["batch"], "--max_seq_len", row["seq_len"], "--packing", "True",
             "--gradient_checkpointing", "True", "--use_reentrant", str(row["checkpointing"] == "reentrant"),
             "--bf16", "True", "--use_flash_attn", str(row["source"].startswith("peft-"))]
    if qlora:
        flags += ["--use_4bit_quantization", "True", "--use_nested_quant", str(row["source"].startswith("peft-")),
                  "--bnb_4bit_compute_dtype", "bfloat16", "--bnb_4bit_quant_storage_dtype", "bfloat16"]
    else:  # the guide's LoRA base as upstream loads it (fp32); Answer.AI's in bf16
        flags += ["--torch_dtype", "float32" if row["source"] == "peft-fsdp-guide" else "bfloat16"]
    return flags


def accelerate_config(row: dict) -> dict:
    sharding = "NO_SHARD" if row["engine"] == "fsdp1-no-shard" else "FULL_SHARD"
    mixed = "bf16" if row["method"] == "lora" and row["source"].startswith("peft-") else "no"
    return {"distributed_type": "FSDP", "num_machines": 1, "num_processes": int(row["gpus"]),
            "mixed_precision": mixed,
            "fsdp_config": {"fsdp_sharding_strategy": sharding, "fsdp_offload_params": row["cpu_offload"] == "yes",
                            "fsdp_cpu_ram_efficient_loading": True}}


def planned_gib(row: dict) -> float | None:
    """The plan's figure of the same kind as the published one, or None (DeepSpeed: not planned yet)."""
    if row["engine"].startswith("deepspeed"):
        return None
    sys.path.insert(0, str(REPO))
    from sft_recipe.plan.inputs import parse_train_flags
    from sft_recipe.plan.planner import plan_memory
    from sft_recipe.plan.result import GIB

    model_args, data_args, _, training_args = parse_train_flags(train_flags(row), "cuda")
    plan = plan_memory(model_args, data_args, training_args, accelerate_config(row), None, 80.0, "cuda",
                       ladder=False)
    rows = {r.name: r.bytes for r in plan.rows}
    peak = plan.peak_gib
    if row["kind"] in ("peak reserved", "peak allocated"):
        peak -= rows.get("framework overhead", 0) / GIB
    if row["kind"] == "peak allocated":
        peak -= rows.get("allocator reserve", 0) / GIB
    return peak


def main() -> int:
    table = read_table()
    print(f"{'source':<22}{'run':<42}{'kind':<16}{'published':>10}{'plan':>8}{'ratio':>8}")
    ratios = []
    for row in table:
        figure = published_gib(row)
        plan = planned_gib(row)
        if plan is None:
            print(f"{row['source']:<22}{row['run']:<42}{row['kind']:<16}{figure:>10.2f}{'-':>8}{'no plan':>8}")
            continue
        ratios.append(plan / figure)
        print(f"{row['source']:<22}{row['run']:<42}{row['kind']:<16}{figure:>10.2f}{plan:>8.2f}{plan / figure:>7.2f}x")
    within = sum(0.85 <= r <= 1.15 for r in ratios)
    below = sum(r < 0.90 for r in ratios)
    print(f"\n{len(ratios)} planned of {len(table)} figures: {within} within +-15%, {below} more than 10% below "
          f"(optimistic), median ratio {statistics.median(ratios):.2f}, worst {min(ratios):.2f}; "
          f"{len(table) - len(ratios)} DeepSpeed figures have no plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
