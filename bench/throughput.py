"""Throughput and memory per rank on CPU, side by side in one run: engines, QLoRA, packing, checkpointing, loading.

    .venv/bin/python bench/throughput.py                   # all setups (about 10 minutes on 2 cores)
    .venv/bin/python bench/throughput.py --only lora-single,lora-fsdp2

Every setup trains the same parameter-dominated random Llama (hidden 1024, 8 layers, 77M parameters, built next to
the tiny tokenizer; needs `python -m sft_recipe.tiny --output_dir .tiny`) for 4 steps of LoRA r=8 on all linear
layers, micro-batch 2, sequence 256, fp32, through the real `accelerate launch`. Columns, from each run's
run_record.json:
    tokens/s         all ranks together, mean over the logged steps after the first (warm-up)
    model state      this rank's weights + gradients + optimizer state (shards under FSDP), MiB: what sharding
                     divides by N
    after load       resident memory per rank once the model is loaded, before wrapping: private (anonymous) + file
                     pages. Weights read from safetensors stay mmapped file pages, which every rank shares through the
                     page cache, until something copies them into private memory.
    peak RSS         per rank, MiB (includes ~480 MiB of torch + transformers import)
CPU offload (`fsdp_offload_params`) needs a GPU and is not a row here. Numbers are for comparing rows of one run:
these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ACCELERATE = str(Path(sys.executable).parent / "accelerate")

FLAGS = ["--dataset_name", ".tiny/data/jsonl", "--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16",
         "--lora_dropout", "0.0", "--lora_target_modules", "all-linear", "--max_steps", "4",
         "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--logging_steps", "1", "--max_seq_len",
         "256", "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no", "--seed", "7",
         "--packing", "True", "--gradient_checkpointing", "True", "--use_reentrant", "False"]
QLORA = ["--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_quant_type", "nf4",
         "--bnb_4bit_quant_storage_dtype", "float32", "--bnb_4bit_compute_dtype", "float32"]
NOT_EFFICIENT = ("--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_sync_module_states", "false")

# name -> (accelerate config under configs/, extra train flags, extra launcher flags, what the row shows)
SETUPS = {
    "lora-single": ("cpu/single.yaml", [], (), "baseline: one process"),
    "lora-fsdp1": ("cpu/fsdp_config.yaml", [], (), "FSDP1, 2 ranks"),
    "lora-fsdp2": ("cpu/fsdp2_config.yaml", [], (), "FSDP2, 2 ranks, cpu_ram_efficient_loading on"),
    "lora-fsdp2-full-load": ("cpu/fsdp2_config.yaml", [], NOT_EFFICIENT, "FSDP2, every rank loads the weights"),
    "qlora-single": ("cpu/single.yaml", QLORA, (), "4-bit NF4 base, one process"),
    "qlora-fsdp2": ("cpu/fsdp2_config.yaml", QLORA, (), "4-bit NF4 base, FSDP2, 2 ranks"),
    "no-packing": ("cpu/single.yaml", ["--packing", "False"], (), "padded batches instead of packing"),
    "packing-wrapped": ("cpu/single.yaml", ["--packing_strategy", "wrapped"], (),
                        "packing that cuts documents (no padding-free)"),
    "no-checkpointing": ("cpu/single.yaml", ["--gradient_checkpointing", "False"], (), "activations kept"),
    "reentrant-checkpointing": ("cpu/single.yaml", ["--use_reentrant", "True"], (), "reentrant checkpointing"),
}


def build_bench_model(root: Path, hidden_size: int = 1024, num_hidden_layers: int = 8) -> Path:
    from sft_recipe.tiny import build_bench_model as build

    return build(root, REPO / ".tiny", hidden_size, num_hidden_layers)


def run(model_dir: Path, work: Path, name: str) -> dict:
    config, flags, launcher, what = SETUPS[name]
    out = work / name
    env = dict(os.environ, ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [ACCELERATE, "launch", "--config_file", str(REPO / "configs" / config), "--main_process_port", "0",
           *launcher, "train.py", "--model_name_or_path", str(model_dir), "--output_dir", str(out), *FLAGS, *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        return {"name": name, "what": what, "error": proc.stdout[-1500:]}
    record = json.loads((out / "run_record.json").read_text())
    memory = record["memory"]
    return {"name": name, "what": what, "ranks": record["distribution"]["num_processes"],
            "tokens_per_second": record["throughput"]["tokens_per_second"],
            "model_state": memory["model_state_mib_per_rank"], "after_load": memory["rss_anon_after_load_mib_per_rank"],
            "after_load_file": memory["rss_file_after_load_mib_per_rank"], "peak_rss": memory["peak_rss_mib_per_rank"]}


def _per_rank(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def print_table(rows: list[dict]) -> None:
    print("| setup | ranks | tokens/s | model state MiB/rank | after load: private + file MiB/rank | "
          "peak RSS MiB/rank | what |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | - | failed | | | | {r['error'].splitlines()[-1][:80]} |")
            continue
        print(f"| {r['name']} | {r['ranks']} | {r['tokens_per_second']:.0f} | {_per_rank(r['model_state'])} | "
              f"{_per_rank(r['after_load'])} + {_per_rank(r['after_load_file'])} | {_per_rank(r['peak_rss'])} | "
              f"{r['what']} |")
    base = {r["name"]: r for r in rows if "error" not in r}
    if "lora-single" in base:
        single = base["lora-single"]["model_state"][0]
        for name in ("lora-fsdp1", "lora-fsdp2"):
            if name in base:
                shares = [v / single for v in base[name]["model_state"]]
                print(f"{name}: model state per rank = {' / '.join(f'{s:.2f}' for s in shares)} of one process "
                      f"(ideal 1/{base[name]['ranks']})")
    if "lora-fsdp2" in base and "lora-fsdp2-full-load" in base:
        on, off = sum(base["lora-fsdp2"]["after_load"]), sum(base["lora-fsdp2-full-load"]["after_load"])
        print(f"private memory after load, all ranks: {on:.0f} MiB with cpu_ram_efficient_loading, {off:.0f} MiB "
              "without")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated setup names: " + ", ".join(SETUPS))
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SETUPS)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        parser.error(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        model_dir = build_bench_model(Path(tmp))
        rows = [run(model_dir, Path(tmp), name) for name in names]
    print_table(rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
