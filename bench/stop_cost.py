"""What watching for divergence costs per step: tokens/s side by side in one run, one CPU process.

    .venv/bin/python bench/stop_cost.py            # 3 setups x 3 rounds, interleaved (about 3 minutes on 2 cores)
    .venv/bin/python bench/stop_cost.py --rounds 1 --steps 20

Setups (the same tiny-model LoRA run, fp32, 60 steps, logging every 10):
    recipe            --stop_on_nonfinite True, logging_nan_inf_filter off (the recipe's defaults)
    no-watch          --stop_on_nonfinite False, filter off: nothing watches the loss
    transformers      --stop_on_nonfinite False --logging_nan_inf_filter True: transformers' own default, whose filter
                      tests every micro-batch loss with a Python `if` on a device value (a sync on a GPU)
On a CPU a device sync costs nothing, so this table shows the Python-side cost only; the GPU check's lora-diverge
row runs the CUDA path (flags read one step late, so no step waits for the device). Rounds are interleaved, and the
median of each setup is printed, because these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SETUPS = {
    "recipe": [],
    "no-watch": ["--stop_on_nonfinite", "False"],
    "transformers": ["--stop_on_nonfinite", "False", "--logging_nan_inf_filter", "True"],
}


def run(name: str, steps: int, out: Path) -> float:
    cmd = [sys.executable, "train.py", "--model_name_or_path", ".tiny/model", "--dataset_name", ".tiny/data/jsonl",
           "--output_dir", str(out), "--use_peft_lora", "True", "--lora_r", "8", "--lora_dropout", "0",
           "--lora_target_modules", "all-linear", "--max_steps", str(steps), "--per_device_train_batch_size", "4",
           "--learning_rate", "1e-3", "--logging_steps", str(max(steps // 6, 1)), "--max_seq_len", "128",
           "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no", "--seed", "7",
           "--packing", "True", "--bf16", "False", "--verify_adapter", "False", *SETUPS[name]]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "run_record.json").read_text())["throughput"]["tokens_per_second"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    if not (REPO / ".tiny/model").is_dir():
        print("error: build the tiny model first: python -m sft_recipe.tiny --output_dir .tiny", file=sys.stderr)
        return 2
    rates: dict[str, list[float]] = {name: [] for name in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name in SETUPS:
                rates[name].append(run(name, args.steps, Path(tmp) / f"{name}-{round_index}"))
    base = statistics.median(rates["no-watch"])
    print("| setup | tokens/s (median) | vs no-watch | rounds |\n|---|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.0f} | {median / base:.3f}x | {', '.join(f'{v:.0f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
