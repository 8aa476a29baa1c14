"""The planner's command line: `python -m sft_recipe.plan` (see the package docstring, sft_recipe/plan/__init__.py)."""

from __future__ import annotations

import argparse
import json
import sys

from sft_recipe.errors import ConfigError
from sft_recipe.plan.components import LOSS_IMPLS
from sft_recipe.plan.gpu import (
    DEFAULT_ALLOCATOR_FLOOR_GIB,
    DEFAULT_ALLOCATOR_RESERVE,
    DEFAULT_CUDA_CONTEXT_GIB,
    DEFAULT_HOST_RUNTIME_GIB,
    DEFAULT_QUANTIZE_THREADS_PER_RANK,
    LOAD_PATHS,
)
from sft_recipe.plan.guide import render_guide_comparison
from sft_recipe.plan.inputs import parse_train_flags, read_accelerate_config
from sft_recipe.plan.planner import plan_memory
from sft_recipe.plan.renting import (
    ENGINES,
    GPUS_PER_MACHINE,
    MAX_GPUS,
    MAX_SEQ_LEN,
    Answer,
    fewest_gpus,
    gpus,
    longest_seq_len,
    run_from_flags,
)
from sft_recipe.plan.result import GIB


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
    p.add_argument("--fsdp_use_orig_params", default=None, choices=["true", "false"],
                   help="override the YAML's fsdp_use_orig_params (FSDP1; as the launcher flag of that name does)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cuda_context_gib", type=float, default=DEFAULT_CUDA_CONTEXT_GIB)
    p.add_argument("--allocator_reserve", type=float, default=DEFAULT_ALLOCATOR_RESERVE)
    p.add_argument("--allocator_floor_gib", type=float, default=DEFAULT_ALLOCATOR_FLOOR_GIB)
    p.add_argument("--host_runtime_gib", type=float, default=DEFAULT_HOST_RUNTIME_GIB)
    p.add_argument("--load_path", default="recipe", choices=LOAD_PATHS,
                   help="where a quantized base loads: 'recipe' (the CPU under FSDP, then FSDP moves it unit by unit) "
                        "or 'upstream' (transformers 5.x's default, as upstream's train.py: whole onto every GPU)")
    p.add_argument("--quantize_threads_per_rank", type=int, default=DEFAULT_QUANTIZE_THREADS_PER_RANK,
                   help="CPU threads each rank quantizes with while loading (train.py gives each rank its share)")
    p.add_argument("--use_dora", action="store_true", help="plan DoRA instead of LoRA (adds a magnitude vector)")
    p.add_argument("--loss_impl", default="trl-chunked", choices=list(LOSS_IMPLS),
                   help="the loss as another stack computed it (train.py: trl-chunked); full-logits: a model's own "
                        "fp32 loss, full-logits-kept: the same with the output held through backward (Answer.AI)")
    p.add_argument("--adapter_dtype", default=None, choices=["float32", "bfloat16"],
                   help="LoRA weights, gradients and Adam moments in this dtype (another stack's; default: as train.py "
                        "keeps them: fp32, bf16 for QLoRA)")
    p.add_argument("--json", action="store_true", help="print MemoryPlan.to_dict() as JSON")
    rent = p.add_argument_group("renting questions (each answer: its plan and the command that launches it)")
    rent.add_argument("--fewest_gpus", action="store_true",
                      help="the fewest GPUs of --gpu_memory_gib that fit the run, per engine, with and without "
                           "fsdp_offload_params (--fsdp_offload_params true|false: that one only)")
    rent.add_argument("--longest_seq_len", action="store_true",
                      help="the longest --max_seq_len that fits the run's setup (--config_file, --num_processes), "
                           "gradient checkpointing on/off x --activation_offloading off/on (CUDA)")
    rent.add_argument("--engines", default=",".join(ENGINES), help=f"--fewest_gpus: any of {','.join(ENGINES)}")
    rent.add_argument("--gpus_per_machine", type=int, default=GPUS_PER_MACHINE,
                      help="--fewest_gpus: beyond one machine, GPUs come in whole machines of this many")
    rent.add_argument("--max_gpus", type=int, default=MAX_GPUS, help="--fewest_gpus: search up to this many")
    rent.add_argument("--max_seq_len_cap", type=int, default=MAX_SEQ_LEN, help="--longest_seq_len: search up to this")
    rent.add_argument("--host_memory_gib", type=float, default=None,
                      help="host RAM of one machine: an answer must fit it too (default: shown, not required)")
    rent.add_argument("--no_breakdown", action="store_true", help="the table and commands only, not each plan")
    return p


def renting(ours: argparse.Namespace, train_argv: list[str]) -> int:
    """--fewest_gpus / --longest_seq_len: the answers as a table with commands and breakdowns, or --json."""
    offload = None if ours.fsdp_offload_params is None else ours.fsdp_offload_params == "true"
    config = read_accelerate_config(ours.config_file)
    if offload is not None:
        config = {**config, "fsdp_config": {**(config.get("fsdp_config") or {}), "fsdp_offload_params": offload}}
    if ours.num_processes:
        config = {**config, "num_processes": ours.num_processes}
    run = run_from_flags(train_argv, ours.config_file, ours.device, config, cuda_context_gib=ours.cuda_context_gib,
                         allocator_reserve=ours.allocator_reserve, allocator_floor_gib=ours.allocator_floor_gib,
                         host_runtime_gib=ours.host_runtime_gib,
                         dora=ours.use_dora, load_path=ours.load_path,
                         quantize_threads_per_rank=ours.quantize_threads_per_rank, loss_impl=ours.loss_impl,
                         adapter_dtype=ours.adapter_dtype)
    if ours.fewest_gpus:
        question = "fewest_gpus"
        answers = fewest_gpus(run, ours.gpu_memory_gib, tuple(e for e in ours.engines.split(",") if e),
                              (False, True) if offload is None else (offload,), ours.gpus_per_machine,
                              ours.max_gpus, ours.host_memory_gib)
    else:
        question = "longest_seq_len"
        answers = longest_seq_len(run, ours.gpu_memory_gib, max_seq_len=ours.max_seq_len_cap,
                                  host_memory_gib=ours.host_memory_gib)
    print(answers_json(question, ours.gpu_memory_gib, answers) if ours.json
          else render_answers(answers, ours.gpu_memory_gib, not ours.no_breakdown))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = build_cli()
    ours, train_argv = cli.parse_known_args(argv)
    if ours.guide:  # the guide's figures against the plan, then its renting answers
        from sft_recipe.plan.guide_renting import render_guide_renting

        print(render_guide_comparison(), *render_guide_renting(), sep="\n")
        return 0
    if ours.gpu_memory_gib is None:
        print("error: --gpu_memory_gib is required: the memory of one GPU in GiB (e.g. 80), or --guide.",
              file=sys.stderr)
        return 2
    if ours.fewest_gpus and ours.longest_seq_len:
        print("error: --fewest_gpus and --longest_seq_len: ask one at a time.", file=sys.stderr)
        return 2
    try:
        if ours.fewest_gpus or ours.longest_seq_len:
            return renting(ours, train_argv)
        config = read_accelerate_config(ours.config_file)
        for key in ("fsdp_offload_params", "fsdp_use_orig_params"):  # the launcher flags of those names
            if getattr(ours, key) is not None:
                config = {**config, "fsdp_config": {**(config.get("fsdp_config") or {}), key: getattr(ours, key) ==
                                                    "true"}}
        model_args, data_args, _, training_args = parse_train_flags(train_argv, ours.device)
        plan = plan_memory(model_args, data_args, training_args, config, ours.num_processes,
                           ours.gpu_memory_gib, ours.device, cuda_context_gib=ours.cuda_context_gib,
                           allocator_reserve=ours.allocator_reserve, allocator_floor_gib=ours.allocator_floor_gib,
                           host_runtime_gib=ours.host_runtime_gib,
                           dora=ours.use_dora, load_path=ours.load_path,
                           quantize_threads_per_rank=ours.quantize_threads_per_rank, loss_impl=ours.loss_impl,
                           adapter_dtype=ours.adapter_dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if ours.json else plan.render())
    return 0


def render_answers(answers: list[Answer], gpu_memory_gib: float, breakdown: bool = True) -> str:
    """The table, each answer's command, then each answer's plan (its rows are the breakdown)."""
    planned = [a.plan for a in answers if a.plan]
    if not planned:
        return "\n".join(["no answer"] + [f"  {a.engine}: {a.note}" for a in answers])
    unit = "GPU" if planned[0].device == "cuda" else "rank"
    fewest = answers[0].question == "fewest_gpus"
    if fewest:
        lines = [f"fewest GPUs of {gpu_memory_gib:g} GiB that fit: {planned[0].model}",
                 f"  {'engine':<8}{'offload':<9}{'GPUs':>5}{'machines':>10}{'per GPU':>10}{'host/machine':>14}"
                 f"{'global batch':>14}   note"]
    else:
        lines = [f"longest --max_seq_len that fits {gpu_memory_gib:g} GiB per {unit}: {planned[0].model}",
                 f"  setup: {planned[0].setup.split(';')[0]}",
                 f"  {'checkpointing':<15}{'activation offloading':<23}{'longest':>9}{f'per {unit}':>10}"
                 f"{'host/machine':>14}   note"]
    for a in answers:
        per = f"{a.plan.peak_gib:.1f}" if a.plan else "-"
        host = f"{a.plan.host_peak_bytes / GIB:.0f}" if a.plan and a.plan.host_rows else "-"
        if fewest:
            count, machines = (f"{a.num_processes}", f"{a.num_machines}") if a.fits else ("-", "-")
            lines.append(f"  {a.engine:<8}{'yes' if a.offload else 'no':<9}{count:>5}{machines:>10}{per:>10}"
                         f"{host:>14}{a.global_batch if a.fits else '-':>14}   {a.note}")
        else:
            lines.append(f"  {'on' if a.checkpointing else 'off':<15}{'on' if a.activation_offloading else 'off':<23}"
                         f"{a.seq_len if a.fits else '-':>9}{per:>10}{host:>14}   {a.note}")
    if fewest:
        lines.append("  (GiB; the global batch is GPUs x micro-batch x accumulation: it grows with the GPUs)")
    lines.append("commands:")
    lines += [f"  {title(a)}:\n    {a.command}" for a in answers if a.fits]
    if breakdown:
        for a in (a for a in answers if a.plan):
            lines += ["", f"--- {title(a)}{'' if a.fits else ' (does not fit)'} ---", a.plan.render()]
    return "\n".join(lines)


def title(a: Answer) -> str:
    if a.question == "fewest_gpus":
        return f"{a.engine}, {'CPU offload' if a.offload else 'no offload'}: {gpus(a.num_processes)}"
    return (f"checkpointing {'on' if a.checkpointing else 'off'}, activation offloading "
            f"{'on' if a.activation_offloading else 'off'}: --max_seq_len {a.seq_len}")


def answers_json(question: str, gpu_memory_gib: float, answers: list[Answer]) -> str:
    return json.dumps({"question": question, "gpu_memory_gib": gpu_memory_gib,
                       "answers": [a.to_dict() for a in answers]}, indent=2)
