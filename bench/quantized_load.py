"""What loading a 4-bit base costs on each engine: where it is placed, host RAM per rank, CPU quantization time.

    .venv/bin/python bench/quantized_load.py            # 3 sizes measured here (~1 min), then the 70B table
    .venv/bin/python bench/quantized_load.py --smoke    # one small size (the test suite's run)

Part 1, measured on this machine: `load_model` as train.py calls it for an FSDP launch (the recipe's placement:
the CPU), on seeded random Llamas of 3 sizes, with 1 thread and with every CPU: seconds, weights quantized per second
per thread, and live weight bytes after loading (packed weights, the rest in bf16, quantization state) against the
plan's formula. The per-thread rate and the bytes-vs-plan ratio must stay flat across sizes for the 70B numbers to
hold. Part 2, planned (sft_recipe.plan): the guide's Llama-2-70B QLoRA run per engine, on 2 GPUs: the device map
asked of from_pretrained on a CUDA launch, GPU memory per rank at the end of loading and through wrapping, host RAM
per machine while loading and each rank's CPU quantization time; upstream's path (no device_map) beside it.
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


def part_planned() -> list[str]:
    from sft_recipe.plan import GIB, parse_train_flags, plan_memory
    from sft_recipe.plan.guide import GUIDE_RUNS, recipe_flags
    from sft_recipe.preflight.load_checks import quantized_base_bytes

    run = GUIDE_RUNS["qlora-2x24-offload"]
    model_args, data_args, _, training_args = parse_train_flags(recipe_flags(run.recipe), "cuda")
    fsdp = run.accelerate_config
    engines = {
        "one process (1 GPU)": (None, "recipe", "quantizer's: this GPU"),
        "DDP (2 GPUs)": ({**fsdp, "distributed_type": "MULTI_GPU", "fsdp_config": {}}, "recipe",
                         "quantizer's: each rank's GPU"),
        "FSDP1 (guide's config)": (fsdp, "recipe", '{"": "cpu"}'),
        "FSDP2": ({**fsdp, "fsdp_config": {**fsdp["fsdp_config"], "fsdp_version": 2}}, "recipe", '{"": "cpu"}'),
        "FSDP1, upstream's path": (fsdp, "upstream", "none: quantizer's, each rank's GPU"),
    }
    lines = ["", f"Planned: the guide's Llama-2-70B QLoRA (NF4, double quant, bf16 storage), 2 ranks, {GPU_GIB:g} GiB "
             "GPUs, CPU offload where FSDP (GiB; quantization at 8 threads per rank):",
             "| engine | device_map asked (CUDA launch) | GPU at load | GPU through wrap | host RAM at load, per "
             "machine | CPU quantization per rank | verdict |", "|---|---|---|---|---|---|---|"]
    for name, (config, path, asked) in engines.items():
        plan = plan_memory(model_args, data_args, training_args, config, None, GPU_GIB, "cuda", ladder=False,
                           load_path=path)
        loading = {r.name: r.bytes for r in plan.host_rows}["loading"]
        verdict = "fits" if plan.fits else f"does not fit at {plan.fails_at}"
        lines.append(f"| {name} | {asked} | {plan.phases['load'] / GIB:.1f} | {plan.phases['wrap'] / GIB:.1f} | "
                     f"{loading / GIB:.1f} | {plan.quantization_seconds / 60:.1f} min | {verdict} |")
    whole = quantized_base_bytes(model_args, data_args, training_args) / GIB
    lines.append(f"| DeepSpeed ZeRO-3 | none allowed (transformers refuses a device_map under ZeRO-3) | "
                 f"{whole + 1:.1f} | {whole + 1:.1f} | 0 | 0 | refused before loading when it exceeds the GPU |")
    lines.append("(GPU figures include the plan's 1 GiB CUDA context; ZeRO-3 is not in the planner: its row is the "
                 "whole quantized base from the planner's formula, as preflight/load_checks.py computes it)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    import os

    os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # parse the guide's --bf16 True on a machine without a GPU
    lines = part_measured(SIZES["smoke" if args.smoke else "full"]) + part_planned()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
