"""The LoRA base in bf16 vs upstream's fp32, side by side at three sizes and on every engine: what halves, and the plan.

    .venv/bin/python bench/dtype_scale.py            # 3 sizes x {one process, FSDP1, FSDP2} x {fp32, bf16} (~6 min)
    .venv/bin/python bench/dtype_scale.py --smoke    # one small size, FSDP2 (~40 s)

Each cell is one real `accelerate launch` of train.py (2 CPU ranks over gloo for FSDP), LoRA all-linear r 8 under bf16
mixed precision (--bf16 True; the base loaded as --torch_dtype says), one optimizer step of a 32-token micro-batch, on
a seeded random Llama stored in bf16 (as Llama-2's checkpoint is), launched with MALLOC_MMAP_THRESHOLD_=65536 so that
anonymous RSS follows live tensor bytes. Per rank, from run_record.json: live weight bytes after loading and after
wrapping (exact: parameter shards, buffers), peak RSS (the training peak, imports included), and the anonymous RSS
right after loading (host RAM at load). The table gives fp32 - bf16 for each, against the plan's saving (the base's
bytes halved: P x 2 B, divided over the ranks once wrapped) and the ratio, which must be 1 within 5%; the slope of the
saving against the model's size says how it grows toward 70B.
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
FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--max_steps", "1", "--per_device_train_batch_size", "1",
         "--max_seq_len", "32", "--packing", "True", "--logging_steps", "1", "--report_to", "none",
         "--save_strategy", "no", "--eval_strategy", "no", "--seed", "7", "--chat_template_format", "none",
         "--bf16", "True", "--verify_adapter", "False"]
ENGINES = {"single": ("cpu/single.yaml", []), "fsdp1": ("cpu/fsdp_config.yaml", ["--use_reentrant", "True"]),
           "fsdp2": ("cpu/fsdp2_config.yaml", [])}
SIZES = {"full": [(512, 4), (1024, 4), (1536, 4)], "smoke": [(256, 2)]}
MIB = 2 ** 20


def build_bf16_model(root: Path, hidden: int, layers: int) -> Path:
    """A seeded random Llama saved in bf16, with the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_recipe.tiny import build_bench_model, build_tiny

    tiny = REPO / ".tiny"
    build_tiny(tiny)
    fp32 = build_bench_model(root, tiny, hidden_size=hidden, num_hidden_layers=layers)
    out = root / f"{fp32.name}-bf16"
    AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(fp32)).save_pretrained(str(out))
    return out


def run(model: Path, engine: str, dtype: str, out: Path) -> dict:
    config, extra = ENGINES[engine]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [ACCELERATE, "launch", "--config_file", str(REPO / "configs" / config), "--main_process_port", str(port),
           "train.py", "--model_name_or_path", str(model), "--dataset_name", str(REPO / ".tiny" / "data" / "jsonl"),
           "--output_dir", str(out), *FLAGS, *extra, "--torch_dtype", dtype]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], file=sys.stderr)
        raise SystemExit(f"{engine} {dtype} failed (exit {proc.returncode})")
    return json.loads((out / "run_record.json").read_text())["memory"]


def planned_saving_mib(model: Path) -> float:
    """What loading the base in bf16 instead of fp32 saves per unsharded copy: P x 2 bytes (the plan's base weights
    at b = 4 minus b = 2; LoRA weights stay fp32 in both)."""
    from sft_recipe.plan import _base_weight_bytes, model_shape, parse_train_flags, workload

    saving = []
    for dtype in ("float32", "bfloat16"):
        argv = ["--model_name_or_path", str(model), *FLAGS, "--torch_dtype", dtype]
        model_args, data_args, _, training_args = parse_train_flags(argv, "cpu")
        shardable, replicated, _ = _base_weight_bytes(model_shape(str(model)),
                                                      workload(model_args, data_args, training_args, "cpu"))
        saving.append(shardable + replicated)
    return (saving[0] - saving[1]) / MIB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # the plan parses --bf16 True as the runs do
    engines = ["fsdp2"] if args.smoke else list(ENGINES)
    lines = ["| model | engine | MiB saved per rank: after load (plan) | after wrap (plan) | ratio load / wrap | "
             "peak RSS fp32 -> bf16 | RSS after load fp32 -> bf16 |", "|---|---|---|---|---|---|---|"]
    slopes: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for hidden, layers in SIZES["smoke" if args.smoke else "full"]:
            model = build_bf16_model(root, hidden, layers)
            plan = planned_saving_mib(model)
            for engine in engines:
                fp32 = run(model, engine, "float32", root / f"{model.name}-{engine}-fp32")
                bf16 = run(model, engine, "bfloat16", root / f"{model.name}-{engine}-bf16")
                shards = 1 if engine == "single" else 2
                load = fp32["weight_mib_after_load_per_rank"][0] - bf16["weight_mib_after_load_per_rank"][0]
                wrap = fp32["weight_mib_after_wrap_per_rank"][-1] - bf16["weight_mib_after_wrap_per_rank"][-1]
                peak = f"{max(fp32['peak_rss_mib_per_rank']):.0f} -> {max(bf16['peak_rss_mib_per_rank']):.0f}"
                rss = f"{fp32['rss_anon_after_load_mib_per_rank'][0]:.0f} -> " \
                      f"{bf16['rss_anon_after_load_mib_per_rank'][0]:.0f}"
                per_shard = plan / shards
                lines.append(f"| {model.name} | {engine} | {load:.1f} ({plan:.1f}) | {wrap:.1f} ({per_shard:.1f}) | "
                             f"{load / plan:.3f} / {wrap / per_shard:.3f} | {peak} | {rss} |")
                slopes.setdefault(engine, []).append((plan * 2, load))
    for engine, points in slopes.items():
        if len(points) > 1:
            from statistics import linear_regression

            slope = linear_regression([x for x, _ in points], [y for _, y in points]).slope
            lines.append(f"- {engine}: saving after load grows {slope:.3f} MiB per MiB of fp32 base (0.5 = halved)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
