"""The planner's command line: `python -m sft_recipe.plan` (see the package docstring, sft_recipe/plan/__init__.py)."""

from __future__ import annotations

import argparse
import json
import sys

from sft_recipe.config.args import ConfigError
from sft_recipe.plan.gpu import (
    DEFAULT_ALLOCATOR_RESERVE,
    DEFAULT_CUDA_CONTEXT_GIB,
    DEFAULT_HOST_RUNTIME_GIB,
    DEFAULT_QUANTIZE_THREADS_PER_RANK,
    LOAD_PATHS,
)
from sft_recipe.plan.guide import render_guide_comparison
from sft_recipe.plan.inputs import parse_train_flags, read_accelerate_config
from sft_recipe.plan.planner import plan_memory


def build_cli() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sft_recipe.plan",
        description="Predict per-rank memory of a training run from the model config (no weights), the accelerate "
                    "YAML and the train.py flags; every unknown flag is passed to train.py's parser.",
        allow_abbrev=False)
    p.add_argument("--config_file", default=None, help="accelerate YAML (as for accelerate launch); none: 1 process")
    p.add_argument("--gpu_memory_gib", type=float, default=None, help="memory of one GPU (cpu mode: RAM per rank)")
    p.add_argument("--guide", action="store_true", help="print the guide's two runs, predicted vs published")
    p.add_argument("--num_processes", type=int, default=None, help="override the YAML's num_processes")
    p.add_argument("--fsdp_offload_params", default=None, choices=["true", "false"],
                   help="override the YAML's fsdp_offload_params (as the launcher flag of that name does)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cuda_context_gib", type=float, default=DEFAULT_CUDA_CONTEXT_GIB)
    p.add_argument("--allocator_reserve", type=float, default=DEFAULT_ALLOCATOR_RESERVE)
    p.add_argument("--host_runtime_gib", type=float, default=DEFAULT_HOST_RUNTIME_GIB)
    p.add_argument("--load_path", default="recipe", choices=LOAD_PATHS,
                   help="where a quantized base loads: 'recipe' (the CPU under FSDP, then FSDP moves it unit by unit) "
                        "or 'upstream' (transformers 5.x's default, as upstream's train.py: whole onto every GPU)")
    p.add_argument("--quantize_threads_per_rank", type=int, default=DEFAULT_QUANTIZE_THREADS_PER_RANK,
                   help="CPU threads each rank quantizes with while loading (train.py gives each rank its share)")
    p.add_argument("--use_dora", action="store_true", help="plan DoRA instead of LoRA (adds a magnitude vector)")
    p.add_argument("--json", action="store_true", help="print MemoryPlan.to_dict() as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = build_cli()
    ours, train_argv = cli.parse_known_args(argv)
    if ours.guide:
        print(render_guide_comparison())
        return 0
    if ours.gpu_memory_gib is None:
        print("error: --gpu_memory_gib is required: the memory of one GPU in GiB (e.g. 80), or --guide.",
              file=sys.stderr)
        return 2
    try:
        config = read_accelerate_config(ours.config_file)
        if ours.fsdp_offload_params is not None:
            config = {**config, "fsdp_config": {**(config.get("fsdp_config") or {}),
                                                "fsdp_offload_params": ours.fsdp_offload_params == "true"}}
        model_args, data_args, _, training_args = parse_train_flags(train_argv, ours.device)
        plan = plan_memory(model_args, data_args, training_args, config, ours.num_processes,
                           ours.gpu_memory_gib, ours.device, cuda_context_gib=ours.cuda_context_gib,
                           allocator_reserve=ours.allocator_reserve, host_runtime_gib=ours.host_runtime_gib,
                           dora=ours.use_dora, load_path=ours.load_path,
                           quantize_threads_per_rank=ours.quantize_threads_per_rank)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if ours.json else plan.render())
    return 0

