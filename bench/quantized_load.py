"""What loading a 4-bit base costs on each engine: where it is placed, host RAM per rank, quantization time.

    .venv/bin/python bench/quantized_load.py            # 3 sizes measured here (~1 min), then the 70B table
    .venv/bin/python bench/quantized_load.py --smoke    # one small size (the test suite's run)
    .venv/bin/python bench/quantized_load.py --ranks    # parts 2 and 3: FSDP1 launched on 2 and 4 ranks (~10 min)

Part 1, measured on this machine: `load_model` as train.py calls it for an FSDP launch (the recipe's placement:
the CPU), on seeded random Llamas of 3 sizes, with 1 thread and with every CPU: seconds, weights quantized per second
per thread, and live weight bytes after loading (packed weights, the rest in bf16, quantization state) against the
plan's formula. The per-thread rate and the bytes-vs-plan ratio must stay flat across sizes for the 70B numbers to
hold. Part 2, planned (sft_recipe.plan): the guide's Llama-2-70B QLoRA run per engine, on 2 GPUs: the device map
asked of from_pretrained on a CUDA launch, GPU memory per rank at the end of loading and through wrapping, host RAM
per machine while loading (2 and 8 ranks) and the quantization time (each weight on the loading rank's GPU; the
CPU's time beside it); upstream's path (no device_map) beside it. Part 3 (--ranks, instead of part 1), measured:
FSDP1 through the real launcher on 2 and 4 CPU ranks at 3 sizes, every rank loading its own copy vs rank 0 alone
(cpu_ram_efficient_loading): host RAM per rank after loading, and its slope.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {"full": [(1024, 4), (2048, 4), (3072, 4)], "smoke": [(256, 2)]}
FLAGS = ["--use_peft_lora", "True", "--use_4bit_quantization", "True", "--use_nested_quant", "True",
         "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bnb_4bit_compute_dtype", "bfloat16", "--bf16", "True",
         "--chat_template_format", "none"]
LLAMA_70B = REPO / "sft_recipe" / "plan" / "models" / "llama-2-70b"
GPU_GIB = 24.0


def measure(model_dir: Path, threads_share: int) -> dict:
    """Load as rank 1 of an FSDP launch whose machine runs `threads_share` ranks (so it quantizes with
    CPUs // threads_share threads): seconds, live weight MiB, weights quantized."""
    from sft_recipe.config.launch_env import LaunchEnv
    from sft_recipe.measure import live_tensor_mib, quant_state_tensors
    from sft_recipe.plan import parse_train_flags
    from sft_recipe.train.model import load_model, load_tokenizer

    launch = LaunchEnv(rank=1, local_rank=1, world_size=threads_share, local_world_size=threads_share,
                       use_cpu=True, use_fsdp=True, fsdp_version=2)
    model_args, _, _, training_args = parse_train_flags(["--model_name_or_path", str(model_dir), *FLAGS], "cpu")
    tokenizer = load_tokenizer(model_args)
    started = time.perf_counter()
    model = load_model(model_args, training_args, tokenizer, launch)
    seconds = time.perf_counter() - started
    mib = live_tensor_mib([*model.parameters(), *model.buffers(), *quant_state_tensors(model)])
    return {"seconds": seconds, "mib": mib, "quantized": _quantized_weights(model)}


def _quantized_weights(model) -> int:
    """Weights bitsandbytes quantized: the original shapes recorded in each quantization state."""
    total = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            total += int(state.shape.numel())
    return total


def planned_mib(model_dir: Path) -> float:
    from sft_recipe.plan import model_shape, parse_train_flags
    from sft_recipe.plan.components import base_weight_bytes
    from sft_recipe.plan.inputs import workload

    model_args, data_args, _, training_args = parse_train_flags(["--model_name_or_path", str(model_dir), *FLAGS],
                                                                "cpu")
    w = workload(model_args, data_args, training_args, "cpu")
    shardable, replicated, _ = base_weight_bytes(model_shape(str(model_dir), False, w.extra_vocab), w)
    return (shardable + replicated) / 2 ** 20


def part_measured(sizes) -> list[str]:
    import os

    from sft_recipe.tiny import build_bench_model

    cpus = len(os.sched_getaffinity(0))
    lines = [f"Measured here ({cpus} CPUs), load_model for an FSDP launch (the base quantized on the CPU):",
             "| model | weights quantized | s, 1 thread | M weights/s/thread | s, "
             f"{cpus} threads | speed-up | live MiB after load | plan MiB | measured/plan |",
             "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as root:
        for hidden, layers in sizes:
            model_dir = build_bench_model(root, Path(root) / "tiny", hidden_size=hidden, num_hidden_layers=layers)
            one = measure(model_dir, threads_share=cpus)  # cpus ranks on the machine: 1 thread each
            every = measure(model_dir, threads_share=1)  # one rank: every CPU
            plan = planned_mib(model_dir)
            rate = one["quantized"] / one["seconds"] / 1e6
            lines.append(f"| llama-{hidden}x{layers} | {one['quantized']:,} | {one['seconds']:.2f} | {rate:.1f} | "
                         f"{every['seconds']:.2f} | {one['seconds'] / every['seconds']:.2f}x | {one['mib']:.1f} | "
                         f"{plan:.1f} | {one['mib'] / plan:.4f} |")
    return lines


RANK_SIZES = {"full": [(512, 4), (1024, 4), (2048, 4)], "smoke": [(256, 2)]}
ONCE = ("--fsdp_cpu_ram_efficient_loading", "true", "--fsdp_sync_module_states", "true")
TRAIN = ["--lora_r", "4", "--lora_alpha", "8", "--bnb_4bit_quant_type", "nf4", "--max_seq_len", "32",
         "--max_steps", "1", "--per_device_train_batch_size", "1", "--report_to", "none", "--save_strategy", "no",
         "--eval_strategy", "no", "--packing", "True", "--use_reentrant", "True"]


def launch_fsdp1(model_dir: Path, data_dir: Path, out: Path, ranks: int, once: bool) -> dict:
    """One FSDP1 QLoRA step through the real launcher on `ranks` CPU ranks: every rank loading its own copy
    (train.py, configs/cpu/fsdp_config.yaml) or rank 0 alone (the guide's efficient loading; FSDP1's module sync
    allowed on CPU by bench/train_syncing_module_states_on_cpu.py). Returns the run record's memory section and the
    load seconds rank 0 logged."""
    import json
    import os
    import re
    import subprocess

    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    script = "bench/train_syncing_module_states_on_cpu.py" if once else "train.py"
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "configs" / "cpu" / "fsdp_config.yaml"), "--num_processes", str(ranks),
           *(ONCE if once else ()), script, "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
           "--output_dir", str(out), *FLAGS, "--bnb_4bit_compute_dtype", "float32", *TRAIN]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    seconds = float(re.search(r"loaded on the CPU for FSDP in ([0-9.]+) s", proc.stdout + proc.stderr).group(1))
    return {**json.loads((out / "run_record.json").read_text())["memory"], "load_s": seconds}


def part_ranks(sizes, rank_counts=(2, 4)) -> list[str]:
    """Host RAM per rank at load, FSDP1, every rank loading vs rank 0 alone: live weight bytes (packed weights,
    the rest in bf16, quantization state: what a GPU rank holds in host RAM before FSDP moves it) and anonymous
    RSS (those plus the process's own ~0.5 GiB), at each size and rank count; then the slope of the other ranks'
    bytes against the 4-bit base's size."""
    from sft_recipe.tiny import build_bench_model, build_tiny

    lines = ["", "Measured here, FSDP1 QLoRA through the real launcher (CPU ranks), host RAM per rank after loading "
             "(MiB; weights: live tensor bytes, anon: anonymous RSS):",
             "| model | 4-bit base (plan) | ranks | who loads | rank 0 weights | other ranks' weights | rank 0 anon | "
             "other ranks' anon (max) | machine's weights | rank 0 load s |", "|---" * 10 + "|"]
    slopes: dict[str, list[tuple[float, float]]] = {"every rank": [], "rank 0 once": []}
    with tempfile.TemporaryDirectory() as root:
        tiny = build_tiny(Path(root) / "tiny")
        for hidden, layers in sizes:
            model_dir = build_bench_model(root, Path(root) / "tiny", hidden_size=hidden, num_hidden_layers=layers)
            plan = planned_mib(model_dir)
            for ranks in rank_counts:
                for who, once in (("every rank", False), ("rank 0 once", True)):
                    m = launch_fsdp1(model_dir, tiny.jsonl_dir, Path(root) / f"out-{hidden}-{ranks}-{once}", ranks,
                                     once)
                    weights, anon = m["weight_mib_after_load_per_rank"], m["rss_anon_after_load_mib_per_rank"]
                    slopes[who].append((plan, max(weights[1:])))
                    lines.append(f"| llama-{hidden}x{layers} | {plan:.1f} | {ranks} | {who} | {weights[0]:.1f} | "
                                 f"{max(weights[1:]):.1f} | {anon[0]:.0f} | {max(anon[1:]):.0f} | {sum(weights):.1f} "
                                 f"| {m['load_s']:.1f} |")
    for who, points in slopes.items():
        (x0, y0), (x1, y1) = min(points), max(points)
        lines.append(f"slope, {who}: another rank's weights grow {(y1 - y0) / (x1 - x0):.4f} MiB per MiB of 4-bit base")
    return lines


def part_planned() -> list[str]:
    from sft_recipe.plan import GIB, parse_train_flags, plan_memory
    from sft_recipe.plan.gpu import DEFAULT_CUDA_CONTEXT_GIB
    from sft_recipe.plan.guide import GUIDE_RUNS, recipe_flags
    from sft_recipe.preflight.load_checks import quantized_base_bytes

    run = GUIDE_RUNS["qlora-2x24-offload"]
    model_args, data_args, _, training_args = parse_train_flags(recipe_flags(run.recipe), "cuda")
    fsdp = run.accelerate_config
    engines = {
        "one process (1 GPU)": (None, "recipe", "quantizer's: this GPU"),
        "DDP (2 GPUs)": ({**fsdp, "distributed_type": "MULTI_GPU", "fsdp_config": {}}, "recipe",
                         "quantizer's: each rank's GPU"),
        "FSDP1 (guide's config: rank 0 loads once)": (fsdp, "recipe", '{"": "cpu"} on rank 0; none elsewhere'),
        "FSDP1 without cpu_ram_efficient_loading": (
            {**fsdp, "fsdp_config": {**fsdp["fsdp_config"], "fsdp_cpu_ram_efficient_loading": False,
                                     "fsdp_sync_module_states": False}}, "recipe", '{"": "cpu"}'),
        "FSDP2": ({**fsdp, "fsdp_config": {**fsdp["fsdp_config"], "fsdp_version": 2}}, "recipe", '{"": "cpu"}'),
        "FSDP1, upstream's path": (fsdp, "upstream", "none: quantizer's, each rank's GPU"),
    }
    lines = ["", f"Planned: the guide's Llama-2-70B QLoRA (NF4, double quant, bf16 storage), 2 ranks, {GPU_GIB:g} GiB "
             "GPUs, CPU offload where FSDP (GiB; quantization: each weight on the loading rank's GPU, and what the "
             "CPU would take at 8 threads per rank quantizing, all 16 for rank 0 alone):",
             "| engine | device_map asked (CUDA launch) | GPU at load | GPU through wrap | host RAM at load, per "
             "machine (2 ranks / 8 ranks) | quantization: GPU (CPU) | verdict |", "|---|---|---|---|---|---|---|"]
    for name, (config, path, asked) in engines.items():
        plan, eight = (plan_memory(model_args, data_args, training_args, config, n, GPU_GIB, "cuda", ladder=False,
                                   load_path=path) for n in (None, 8 if config else None))
        loading = [{r.name: r.bytes for r in p.host_rows}["loading"] / GIB for p in (plan, eight)]
        verdict = "fits" if plan.fits else f"does not fit at {plan.fails_at}"
        quantized = (f"{plan.quantization_seconds:.0f} s ({plan.cpu_quantization_seconds / 60:.1f} min)"
                     if plan.quantization_seconds else "in the quantizer's load")
        lines.append(f"| {name} | {asked} | {plan.phases['load'] / GIB:.1f} | {plan.phases['wrap'] / GIB:.1f} | "
                     f"{loading[0]:.1f} / {loading[1]:.1f} | {quantized} | {verdict} |")
    at_load = quantized_base_bytes(model_args, data_args, training_args) / GIB + DEFAULT_CUDA_CONTEXT_GIB
    lines.append(f"| DeepSpeed ZeRO-3 | none allowed (transformers refuses a device_map under ZeRO-3) | "
                 f"{at_load:.1f} | {at_load:.1f} | 0 | 0 | refused before loading when it exceeds the GPU |")
    lines.append(f"(GPU figures include the plan's {DEFAULT_CUDA_CONTEXT_GIB:g} GiB CUDA context; 8 ranks: one "
                 "machine; the ZeRO-3 row is the whole quantized base from the planner's formula, as "
                 "preflight/load_checks.py computes it)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ranks", action="store_true", help="launch FSDP1 on 2 and 4 CPU ranks at 3 sizes, every "
                        "rank loading vs rank 0 alone (~10 min), instead of part 1")
    args = parser.parse_args()
    import os

    os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # parse the guide's --bf16 True on a machine without a GPU
    if args.ranks:  # real launches: minutes
        lines = part_planned() + part_ranks(RANK_SIZES["smoke" if args.smoke else "full"])
    else:
        lines = part_measured(SIZES["smoke" if args.smoke else "full"]) + part_planned()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
