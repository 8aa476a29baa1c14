"""What FSDP1's `fsdp_use_orig_params: true` costs against the guide's `false`, and what --train_new_tokens adds on top
(it needs `true` under FSDP1: `false` cannot flatten the new rows' parameter beside the frozen embedding).

    .venv/bin/python bench/use_orig_params.py            # LoRA and QLoRA x {false, true, true + new rows}, and
                                                         # FSDP2 without and with the rows (~10 min)
    .venv/bin/python bench/use_orig_params.py --smoke    # LoRA, false and true + new rows, a smaller model

Each cell is one real `accelerate launch --config_file configs/cpu/fsdp_config.yaml --fsdp_use_orig_params ...` of
train.py on 2 CPU ranks (gloo), the same model, data and flags (chatml, so the tokenizer has new tokens in every
cell; only the last cell of each method trains their rows), launched with MALLOC_MMAP_THRESHOLD_=65536 so that
anonymous RSS follows live tensor bytes. Read from each run's run_record.json: peak RSS per rank (on CPU the device
memory *is* the process's memory) and tokens/s per device (median of the steps after the first). The model is a
Llama whose tokenizer carries 8,000 extra plain tokens, so that the root unit (embeddings, norm, head: where the new
rows live) is large enough to see. Beside each cell, the memory plan's CPU figure for the same run, and at the end
the plan's GPU figures for the guide's 70B runs (QLoRA on 2 x 24 GB, LoRA on 8 x 80 GB) with the same three
settings.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
CONFIG = REPO / "configs" / "cpu" / "fsdp_config.yaml"
FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--chat_template_format", "chatml", "--max_steps", "6",
         "--per_device_train_batch_size", "2", "--max_seq_len", "128", "--packing", "True", "--learning_rate", "1e-3",
         "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no",
         "--seed", "7"]
METHODS = {"lora": ["--bf16", "False"],
           # FSDP1 refuses fp32 storage for 4-bit weights: bf16 storage, fp32 compute (as bench/scale.py), and the
           # guide's reentrant checkpointing (FSDP1 on CPU under bf16 refuses the other kind)
           "qlora": ["--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16",
                     "--bnb_4bit_compute_dtype", "float32", "--bf16", "True", "--use_reentrant", "True"]}
CELLS = {"false": ("false", []), "true": ("true", []), "true + new rows": ("true", ["--train_new_tokens", "True"])}
# FSDP2 beside them: what the new rows cost where no setting is needed (PEFT's merged weights and their gradients)
FSDP2_CELLS = {"FSDP2": [], "FSDP2 + new rows": ["--train_new_tokens", "True"]}
FSDP2_CONFIG = REPO / "configs" / "cpu" / "fsdp2_config.yaml"
EXTRA_TOKENS = 8000


def build_model(root: Path, hidden: int, layers: int) -> Path:
    """The tiny tokenizer with EXTRA_TOKENS plain tokens more, and a seeded random Llama of that vocabulary."""
    from transformers import AutoTokenizer

    from sft_recipe.tiny import build_tiny
    from sft_recipe.tiny.build import build_model as build_llama

    tiny = REPO / ".tiny"
    build_tiny(tiny)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny / "model"))
    tokenizer.add_tokens([f"word{i}" for i in range(EXTRA_TOKENS)])
    model = build_llama(tokenizer, hidden_size=hidden, num_hidden_layers=layers)
    folder = root / f"llama-{hidden}x{layers}-v{len(tokenizer)}"
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_dir: Path, method: str, orig: str | None, extra: list[str], out: Path) -> dict:
    """One run: FSDP1 with fsdp_use_orig_params `orig`, or FSDP2 where `orig` is None."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    engine = ["--config_file", str(FSDP2_CONFIG)] if orig is None else \
        ["--config_file", str(CONFIG), "--fsdp_use_orig_params", orig]
    cmd = [ACCELERATE, "launch", *engine,
           "--main_process_port", str(_free_port()), str(REPO / "train.py"), "--model_name_or_path", str(model_dir),
           "--dataset_name", str(REPO / ".tiny" / "data" / "jsonl"), "--output_dir", str(out), *FLAGS,
           *METHODS[method], *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
        raise SystemExit(f"{method} use_orig_params {orig} {extra} failed (exit {proc.returncode})")
    record = json.loads((out / "run_record.json").read_text())
    speeds = [log["tokens_per_second_per_device"] for log in record["throughput"]["per_log"][1:]]
    return {"peak_rss_mib": record["memory"]["peak_rss_mib_per_rank"],
            "tokens_per_second_per_device": statistics.median(speeds), "losses": record["training"]["losses"]}


def plan_rss_mib(model_dir: Path, method: str, orig: str | None, extra: list[str]) -> list[float]:
    """The memory plan's peak RSS per rank for the same run (device cpu)."""
    from sft_recipe.plan import parse_train_flags, plan_memory, read_accelerate_config

    argv = ["--model_name_or_path", str(model_dir), *FLAGS, *METHODS[method], *extra]
    model_args, data_args, _, training_args = parse_train_flags(argv, "cpu")
    config = dict(read_accelerate_config(FSDP2_CONFIG if orig is None else CONFIG))
    config["fsdp_config"] = {**config["fsdp_config"], "fsdp_use_orig_params": orig == "true"}
    plan = plan_memory(model_args, data_args, training_args, config, 2, 1000.0, "cpu", ladder=False)
    return [b / 2**20 for b in plan.per_rank_bytes]


def guide_plans() -> list[tuple[str, str, float, float]]:
    """(run, setting, GPU peak GiB per rank, host RAM peak GiB) of the guide's 70B runs in each setting."""
    from sft_recipe.plan import parse_train_flags, plan_memory, read_accelerate_config

    model = str(REPO / "sft_recipe" / "plan" / "models" / "llama-2-70b")
    rows = []
    for run, recipe, config_name, n, gpu_gib in [
            ("QLoRA 2 x 24 GB (offload)", "llama2_70b_qlora.yaml", "fsdp_config_qlora.yaml", 2, 24.0),
            ("LoRA 8 x 80 GB", "llama2_70b_lora.yaml", "fsdp_config.yaml", 8, 80.0)]:
        for cell, (orig, extra) in CELLS.items():
            if recipe == "llama2_70b_lora.yaml" and extra:  # a bf16 base: refused under FSDP1 (preflight/validate.py)
                rows.append((run, cell, None, None))
                continue
            argv = ["--config", str(REPO / "recipes" / recipe), "--model_name_or_path", model, *extra]
            model_args, data_args, _, training_args = parse_train_flags(argv, "cuda")
            config = dict(read_accelerate_config(REPO / "configs" / config_name))
            config["fsdp_config"] = {**config["fsdp_config"], "fsdp_use_orig_params": orig == "true"}
            plan = plan_memory(model_args, data_args, training_args, config, n, gpu_gib, "cuda", ladder=False)
            rows.append((run, cell, plan.peak_gib, plan.host_peak_bytes / 2**30))
    return rows


def print_row(method: str, cell: str, run: dict, plan: list[float], base: dict) -> None:
    more = max(run["peak_rss_mib"]) - max(base["peak_rss_mib"])
    speed = run["tokens_per_second_per_device"] / base["tokens_per_second_per_device"]
    print(f"| {method} | {cell} | {'/'.join(f'{x:.0f}' for x in run['peak_rss_mib'])} "
          f"[{'/'.join(f'{x:.0f}' for x in plan)}] | {more:+.0f} MiB | {run['tokens_per_second_per_device']:.0f} | "
          f"{speed:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="LoRA only, use_orig_params false and true + new rows")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: lora, qlora")
    args = parser.parse_args(argv)
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # the plan parses bf16 flags as the CPU runs do
    methods = ["lora"] if args.smoke else args.methods.split(",")
    cells = ["false", "true + new rows"] if args.smoke else list(CELLS)
    hidden, layers = (128, 2) if args.smoke else (512, 4)
    print("| method | fsdp_use_orig_params (FSDP1), or FSDP2 | peak RSS MiB per rank [plan] | vs the first row of "
          "its engine | tokens/s per device | vs the first row of its engine |")
    print("|---" * 6 + "|")
    with tempfile.TemporaryDirectory(prefix="orig-params-") as tmp:
        model_dir = build_model(Path(tmp), hidden, layers)
        for method in methods:
            base = None
            for cell in cells:
                orig, extra = CELLS[cell]
                run = launch(model_dir, method, orig, extra, Path(tmp) / f"{method}-{cell.replace(' ', '')}")
                base = base or run
                print_row(method, cell, run, plan_rss_mib(model_dir, method, orig, extra), base)
            base = None
            for cell, extra in ({} if args.smoke else FSDP2_CELLS).items():
                run = launch(model_dir, method, None, extra, Path(tmp) / f"{method}-{cell.replace(' ', '')}")
                base = base or run
                print_row(method, cell, run, plan_rss_mib(model_dir, method, None, extra), base)
    print("\nThe memory plan at 70B (GPU peak per rank; host RAM peak of the machine):")
    print("| run | fsdp_use_orig_params | GPU peak GiB/rank | host RAM GiB |")
    print("|---" * 4 + "|")
    for run, cell, gpu, host in guide_plans():
        if gpu is None:
            print(f"| {run} | {cell} | refused before load (a bf16 base; FSDP2 trains the rows) | - |")
        else:
            print(f"| {run} | {cell} | {gpu:.2f} | {host:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
