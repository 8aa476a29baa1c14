"""The memory plan beside every GPU figure others measured and published (tests/published_gpu_memory.csv).

    .venv/bin/python bench/plan_vs_published.py          # one line per published figure, then the summary
    .venv/bin/python bench/plan_vs_published.py --fit    # the overhead settings that fit the table best
    .venv/bin/python bench/plan_vs_published.py --cross_validate   # each source predicted from a fit on the others
    .venv/bin/python bench/plan_vs_published.py --markdown   # the table docs/memory-and-speed.md shows

Each row of the table is planned as the source ran it (model, engine and its accelerate YAML, GPUs, CPU offload,
batch, sequence length, LoRA rank, alpha and targets, checkpointing, the loss its stack computed and the LoRA dtype
it trained in: the table's loss_impl and adapter_dtype columns), from the architectures shipped in
sft_recipe/plan/models, and set against the train step's phase (every figure was read while training). The figure's
kind decides what of the plan it is set against: "nvidia-smi" (the whole process on the GPU) all of it;
"peak reserved" (torch.cuda.max_memory_reserved, no CUDA context) without the framework-overhead row; "peak
allocated" without that row and the allocator's reserve. Ratio = plan / published: above 1 the plan is pessimistic,
below 1 it would say "fits" for a run that may not."""

from __future__ import annotations

import csv
import functools
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
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
             "--per_device_train_batch_size", row["batch"], "--max_seq_len", row["seq_len"],
             # the guide packs; Answer.AI's benchmark rows are seq_len tokens each, with no attention mask
             "--packing", str(row["source"] != "answerai-benchmarks"),
             "--gradient_checkpointing", "True", "--use_reentrant", str(row["checkpointing"] == "reentrant"),
             "--bf16", "True", "--use_flash_attn", str(row["source"].startswith("peft-"))]
    if qlora:
        flags += ["--use_4bit_quantization", "True", "--use_nested_quant", str(row["source"].startswith("peft-")),
                  "--bnb_4bit_compute_dtype", "bfloat16", "--bnb_4bit_quant_storage_dtype", "bfloat16"]
    else:  # the guide's LoRA base as upstream loads it (fp32); Answer.AI's in bf16
        flags += ["--torch_dtype", "float32" if row["source"] == "peft-fsdp-guide" else "bfloat16"]
    return flags


def accelerate_config(row: dict) -> dict:
    if row["engine"] == "deepspeed-zero3":  # the shipped YAMLs the guide's scripts launch with
        import yaml

        name = "deepspeed_config_z3_qlora.yaml" if row["method"] == "qlora" else "deepspeed_config.yaml"
        cfg = yaml.safe_load((REPO / "configs" / name).read_text())
        return {**cfg, "num_processes": int(row["gpus"])}
    sharding = "NO_SHARD" if row["engine"] == "fsdp1-no-shard" else "FULL_SHARD"
    mixed = "bf16" if row["method"] == "lora" and row["source"].startswith("peft-") else "no"
    return {"distributed_type": "FSDP", "num_machines": 1, "num_processes": int(row["gpus"]),
            "mixed_precision": mixed,
            "fsdp_config": {"fsdp_sharding_strategy": sharding, "fsdp_offload_params": row["cpu_offload"] == "yes",
                            "fsdp_cpu_ram_efficient_loading": True}}


@functools.cache
def _shape(model: str, extra_vocab: int):
    """One meta-device count per architecture, however many rows plan it."""
    from sft_recipe.plan.shape import model_shape

    return model_shape(model, False, extra_vocab)


def planned_gib(row: dict, **knobs) -> float | None:
    """The plan's figure of the same kind as the published one. `knobs`:
    plan_memory's overhead settings (cuda_context_gib, allocator_floor_gib, allocator_reserve)."""
    from sft_recipe.plan.inputs import parse_train_flags, workload
    from sft_recipe.plan.planner import plan_memory
    from sft_recipe.plan.result import GIB

    model_args, data_args, _, training_args = parse_train_flags(train_flags(row), "cuda")
    shape = _shape(row["model"], workload(model_args, data_args, training_args, "cuda").extra_vocab)
    plan = plan_memory(model_args, data_args, training_args, accelerate_config(row), None, 80.0, "cuda",
                       ladder=False, loss_impl=row["loss_impl"], adapter_dtype=row["adapter_dtype"], shape=shape,
                       **knobs)
    rows = {r.name: r.bytes for r in plan.rows}
    # Every figure was read while training: the train step's phase. (Loading differs on today's stack: under ZeRO-3
    # transformers 5.x puts the whole 4-bit base on each GPU before partitioning it, where the guide's stack
    # partitioned it as it loaded; the plan's load phase says so, and the recipe refuses it where it does not fit.)
    peak = plan.phases["train step"] / GIB
    if row["kind"] in ("peak reserved", "peak allocated"):
        peak -= rows.get("framework overhead", 0) / GIB
    if row["kind"] == "peak allocated":
        peak -= rows.get("allocator reserve", 0) / GIB
    return peak


GRID = [(floor / 10, fraction / 100, context) for floor in range(0, 31) for fraction in range(0, 101, 5)
        for context in (0.5, 1.0, 1.5, 2.0, 2.5)]  # (allocator floor GiB, allocator fraction, CUDA context GiB)


@functools.cache
def _bare_and_unit(table_key: tuple) -> tuple[list[float], list[float]]:
    """Per row, the plan with no overhead and with the fraction's base (floor 0, fraction 1): the rest is arithmetic."""
    table = [dict(items) for items in table_key]
    bare = [planned_gib(r, cuda_context_gib=0.0, allocator_floor_gib=0.0, allocator_reserve=0.0) for r in table]
    unit = [planned_gib(r, cuda_context_gib=0.0, allocator_floor_gib=0.0, allocator_reserve=1.0) for r in table]
    return bare, unit


def ratios_with(table: list[dict], knobs: tuple[float, float, float], rows: list[int]) -> list[float]:
    """plan / published for `rows` of `table` with the overheads `knobs` (floor, fraction, context)."""
    bare, unit = _bare_and_unit(tuple(tuple(r.items()) for r in table))
    floor, fraction, context = knobs
    ratios = []
    for i in rows:
        row = table[i]
        plan = bare[i] if row["kind"] == "peak allocated" else bare[i] + floor + fraction * (unit[i] - bare[i])
        plan += context if row["kind"] == "nvidia-smi" else 0.0
        ratios.append(plan / published_gib(row))
    return ratios


def fit_overheads(table: list[dict], rows: list[int] | None = None) -> list[tuple]:
    """Every (allocator floor, allocator fraction, context) on a grid, ranked by how many planned figures of `rows`
    (all by default) land within -10%/+15%, then by the worst ratio: the search that set the planner's defaults
    (sft_recipe/plan/gpu.py)."""
    rows = list(range(len(table))) if rows is None else rows
    results = []
    for floor, fraction, context in GRID:
        ratios = ratios_with(table, (floor, fraction, context), rows)
        inside = sum(0.90 <= r <= 1.15 for r in ratios)
        results.append((inside, round(min(ratios), 3), floor, fraction, context, round(max(ratios), 3)))
    return sorted(results, reverse=True)


def cross_validate(table: list[dict]) -> list[dict]:
    """Leave one source out: the overheads fitted on the other sources' figures, then set against the held-out
    source's (out of sample), beside the planner's shipped constants on the same figures (in sample: they were
    chosen on the whole table). One entry per source."""
    from sft_recipe.plan.gpu import DEFAULT_ALLOCATOR_FLOOR_GIB, DEFAULT_ALLOCATOR_RESERVE, DEFAULT_CUDA_CONTEXT_GIB

    shipped = (DEFAULT_ALLOCATOR_FLOOR_GIB, DEFAULT_ALLOCATOR_RESERVE, DEFAULT_CUDA_CONTEXT_GIB)
    results = []
    for source in dict.fromkeys(r["source"] for r in table):
        held_out = [i for i, r in enumerate(table) if r["source"] == source]
        others = [i for i, r in enumerate(table) if r["source"] != source]
        _, _, *fitted, _ = fit_overheads(table, others)[0]
        results.append({"source": source, "figures": len(held_out), "fitted": tuple(fitted),
                        "in_sample": ratios_with(table, shipped, held_out),
                        "out_of_sample": ratios_with(table, tuple(fitted), held_out)})
    return results


def cross_validation_lines(results: list[dict]) -> list[str]:
    def stats(ratios: list[float]) -> str:
        inside = sum(0.90 <= r <= 1.15 for r in ratios)
        return f"{inside:>3}/{len(ratios):<3}{statistics.median(ratios):>7.2f}{min(ratios):>7.2f}{max(ratios):>7.2f}"

    lines = [f"{'held-out source':<22}{'fitted on the others (floor, fraction, context)':<48}"
             f"{'in sample: inside median worst highest':<42}{'out of sample: inside median worst highest'}"]
    for r in results:
        floor, fraction, context = r["fitted"]
        lines.append(f"{r['source']:<22}{f'{floor:.1f} GiB, {fraction:.2f}, {context:.1f} GiB':<48}"
                     f"{stats(r['in_sample']):<42}{stats(r['out_of_sample'])}")
    every = [x for r in results for x in r["out_of_sample"]]
    lines.append(f"out of sample, every figure: {sum(0.90 <= x <= 1.15 for x in every)} of {len(every)} within "
                 f"-10%/+15%, {sum(x < 0.90 for x in every)} more than 10% below, median "
                 f"{statistics.median(every):.2f}, worst {min(every):.2f}")
    return lines


def main() -> int:
    table = read_table()
    if "--cross_validate" in sys.argv:
        print(*cross_validation_lines(cross_validate(table)), sep="\n")
        return 0
    if "--fit" in sys.argv:
        print(f"{'inside':>7}{'worst':>7}{'floor GiB':>10}{'fraction':>9}{'context GiB':>12}{'highest':>8}")
        for inside, worst, floor, fraction, context, highest in fit_overheads(table)[:15]:
            print(f"{inside:>7}{worst:>7.3f}{floor:>10.1f}{fraction:>9.2f}{context:>12.1f}{highest:>8.3f}")
        return 0
    ratios = []
    markdown = "--markdown" in sys.argv
    if markdown:
        print(*markdown_lines(table), sep="\n")
    else:
        print(f"{'source':<22}{'run':<42}{'kind':<16}{'published':>10}{'plan':>8}{'ratio':>8}")
    for row in table:
        figure = published_gib(row)
        plan = planned_gib(row)
        ratios.append(plan / figure)
        if not markdown:
            print(f"{row['source']:<22}{row['run']:<42}{row['kind']:<16}{figure:>10.2f}{plan:>8.2f}"
                  f"{plan / figure:>7.2f}x")
    print("\n" + summary(ratios, len(table)))
    return 0


def markdown_lines(table: list[dict]) -> list[str]:
    """The table as docs/memory-and-speed.md shows it (tests/unit/test_published_figures.py holds them equal)."""
    lines = ["| source | run | engine, GPUs | kind | published GiB | plan GiB | ratio |",
             "|---|---|---|---|---|---|---|"]
    for row in table:
        plan = planned_gib(row)
        engine = f"{row['engine']}{' + offload' if row['cpu_offload'] == 'yes' else ''}, {row['gpus']}"
        lines.append(f"| {row['source']} | {row['run']} | {engine} | {row['kind']} | {row['figure']} | {plan:.2f} | "
                     f"{plan / published_gib(row):.2f} |")
    return lines


def summary(ratios: list[float], figures: int) -> str:
    within = sum(0.90 <= r <= 1.15 for r in ratios)
    below = sum(r < 0.90 for r in ratios)
    return (f"{len(ratios)} planned of {figures} figures: {within} within -10%/+15%, {below} more than 10% below "
            f"(optimistic), median ratio {statistics.median(ratios):.2f}, worst {min(ratios):.2f}")


if __name__ == "__main__":
    sys.exit(main())
