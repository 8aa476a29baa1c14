"""How close is the memory plan? Real runs through `accelerate launch`, predicted vs measured peak memory per rank.

    .venv/bin/python bench/memory_plan.py                 # CPU: peak RSS per rank (about 8 minutes on 2 cores)
    .venv/bin/python bench/memory_plan.py --only lora-fsdp1-s128,qlora-single-s128
    .venv/bin/python bench/memory_plan.py --gpu           # GPU machine: torch.cuda.max_memory_allocated, rank 0

Needs the tiny tokenizer and data (`python -m sft_recipe.tiny --output_dir .tiny`; built here when missing). The
model is a random Llama whose weights dominate the memory (hidden 1024, 8 layers, 77M parameters, 292 MiB in fp32),
built into a temporary folder next to the tiny tokenizer. Every setup trains 3 steps (LoRA r=8 all-linear, micro-batch
2, packing) on CPU in fp32 over gloo -- one process, FSDP1 and FSDP2 on 2 ranks, LoRA and QLoRA (NF4, double quant,
fp32 storage and compute: bf16 is emulated on CPUs), two sequence lengths, checkpointing on/off -- and its peak RSS
per rank (run_record.json) is compared with `sft_recipe.plan` in cpu mode. CPU offload cannot run without a GPU
(torch pins offloaded shards in page-locked memory): its row is listed as not runnable here and runs with --gpu.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
BASE_FLAGS = ["--dataset_name", ".tiny/data/jsonl", "--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16",
              "--lora_dropout", "0.0", "--lora_target_modules", "all-linear", "--max_steps", "3",
              "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
              "--packing", "True", "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no",
              "--seed", "7", "--verify_adapter", "True"]
QLORA = ["--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_quant_type", "nf4",
         "--bnb_4bit_quant_storage_dtype", "float32", "--bnb_4bit_compute_dtype", "float32"]
NO_GC = ["--max_seq_len", "128", "--gradient_checkpointing", "False"]
GC_512 = ["--max_seq_len", "512", "--gradient_checkpointing", "True"]

# name -> (accelerate config, extra flags, launcher args). CPU configs; --gpu swaps in the GPU twins.
SETUPS = {
    "lora-single-s128": ("cpu/single.yaml", NO_GC, ()),
    "lora-single-s512-gc": ("cpu/single.yaml", GC_512, ()),
    "lora-fsdp1-s128": ("cpu/fsdp_config.yaml", NO_GC, ()),
    "lora-fsdp1-s512-gc": ("cpu/fsdp_config.yaml", GC_512, ()),
    "lora-fsdp2-s128": ("cpu/fsdp2_config.yaml", NO_GC, ()),
    "lora-fsdp2-s512-gc": ("cpu/fsdp2_config.yaml", GC_512, ()),
    "qlora-single-s128": ("cpu/single.yaml", QLORA + NO_GC, ()),
    "qlora-fsdp2-s512-gc": ("cpu/fsdp2_config.yaml", QLORA + GC_512, ()),
    "lora-fsdp1-s128-offload": ("cpu/fsdp_config.yaml", NO_GC, ("--fsdp_offload_params", "true")),
}
GPU_CONFIG = {"cpu/single.yaml": "single.yaml", "cpu/fsdp_config.yaml": "fsdp_config.yaml",
              "cpu/fsdp2_config.yaml": "fsdp2_config.yaml"}
CPU_UNRUNNABLE = {"lora-fsdp1-s128-offload": "offload pins shards in page-locked memory, which needs a GPU"}


def build_bench_model(root: Path, hidden_size: int = 1024, num_hidden_layers: int = 8) -> Path:
    from sft_recipe.tiny import build_bench_model as build

    return build(root, REPO / ".tiny", hidden_size, num_hidden_layers)


def launch_env(gpu: bool) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if not gpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def accelerate_config(config: str, launcher_args: tuple[str, ...], num_processes: int | None) -> dict:
    from sft_recipe.plan import read_accelerate_config

    cfg = dict(read_accelerate_config(REPO / "configs" / config))
    if "--fsdp_offload_params" in launcher_args:
        cfg["fsdp_config"] = {**cfg.get("fsdp_config", {}), "fsdp_offload_params": True}
    if num_processes:
        cfg["num_processes"] = num_processes
    return cfg


def predict(model_dir: Path, config: dict, flags: list[str], device: str) -> list[float]:
    """Predicted peak per rank, MiB (cpu: RSS; cuda: allocated, without context and allocator reserve)."""
    from sft_recipe.plan import MIB, parse_train_flags, plan_memory

    model_args, data_args, _, training_args = parse_train_flags(
        ["--model_name_or_path", str(model_dir), *BASE_FLAGS, *flags], device)
    plan = plan_memory(model_args, data_args, training_args, config, None, 1000.0, device, ladder=False)
    if device == "cpu":
        return [b / MIB for b in plan.per_rank_bytes]
    # max_memory_allocated counts neither the CUDA context nor what the caching allocator reserves beyond it.
    not_allocated = sum(r.bytes for r in plan.rows if r.name in ("allocator reserve", "framework overhead"))
    return [(plan.phases["train step"] - not_allocated) / MIB]


def run(model_dir: Path, work: Path, name: str, gpu: bool, num_gpus: int) -> dict:
    config, flags, launcher_args = SETUPS[name]
    if gpu:
        config = GPU_CONFIG[config]
    out = work / name
    cmd = [ACCELERATE, "launch", "--config_file", str(REPO / "configs" / config), *launcher_args]
    if gpu and config != "single.yaml":
        cmd += ["--num_processes", str(num_gpus)]
    cmd += ["train.py", "--output_dir", str(out), "--model_name_or_path", str(model_dir), *BASE_FLAGS, *flags]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(gpu), capture_output=True, text=True)
    seconds = time.time() - start
    if proc.returncode:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{tail}")
    facts = json.loads((out / "run_record.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    cfg = accelerate_config(config, launcher_args, num_gpus if gpu and config != "single.yaml" else None)
    if gpu:
        measured = [facts["memory"]["peak_gpu_memory_gib"] * 1024]
        predicted = predict(model_dir, cfg, flags, "cuda")[:1]
    else:
        measured = facts["memory"]["peak_rss_mib_per_rank"]
        predicted = predict(model_dir, cfg, flags, "cpu")
    how = facts["distribution"]
    return {"name": name, "measured_mib": measured, "predicted_mib": [round(p, 1) for p in predicted],
            "seconds": round(seconds, 1),
            "distributed": f"{how['distributed_type']}{how.get('fsdp_version') or ''}"}


def print_table(results: list[dict], skipped: dict[str, str], what: str) -> float:
    print(f"\n{what}: predicted vs measured, per rank (MiB)")
    print(f"{'setup':<26}{'rank':>5}{'predicted':>11}{'measured':>10}{'error':>9}{'run s':>8}")
    worst = 0.0
    for r in results:
        for rank, (p, m) in enumerate(zip(r["predicted_mib"], r["measured_mib"])):
            err = (p - m) / m * 100
            worst = max(worst, abs(err))
            print(f"{r['name']:<26}{rank:>5}{p:>11.0f}{m:>10.0f}{err:>+8.1f}%{r['seconds'] if rank == 0 else '':>8}")
    for name, why in skipped.items():
        print(f"{name:<26}{'':>5}{'-':>11}{'-':>10}{'':>9}   not runnable here: {why}")
    print(f"largest error: {worst:.1f}%")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="measure torch.cuda.max_memory_allocated on GPUs")
    parser.add_argument("--only", default="", help="comma-separated setup names (default: all)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--repeat", type=int, default=1,
                        help="launch each setup this many times and report each (peak RSS varies ~5%% per launch)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SETUPS)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        parser.error(f"--only: unknown setup(s) {unknown}; known: {', '.join(SETUPS)}")
    num_gpus = 0
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("error: --gpu needs a CUDA GPU and none is visible (torch.cuda.is_available() is False). Run "
                  "without --gpu to compare CPU peak RSS instead.", file=sys.stderr)
            return 2
        num_gpus = torch.cuda.device_count()
    skipped = {} if args.gpu else {n: CPU_UNRUNNABLE[n] for n in names if n in CPU_UNRUNNABLE}
    work = Path(tempfile.mkdtemp(prefix="memory-plan-"))
    try:
        model_dir = build_bench_model(work)
        results = []
        for name in names:
            if name in skipped:
                continue
            for _ in range(max(1, args.repeat)):
                results.append(run(model_dir, work, name, args.gpu, num_gpus))
                r = results[-1]
                print(f"{name}: predicted {r['predicted_mib']} measured {r['measured_mib']} MiB ({r['seconds']} s)",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = "GPU max_memory_allocated, rank 0" if args.gpu else "CPU peak RSS"
    worst = print_table(results, skipped, what)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "skipped": skipped, "largest_error_pct": worst},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
