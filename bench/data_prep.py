"""Data preparation at scale: time to the first optimizer step and peak RSS, ours vs upstream's path, one process.

    .venv/bin/python bench/data_prep.py                      # 2,000 / 10,000 / 30,000 rows, cold and warm (~15 min)
    .venv/bin/python bench/data_prep.py --rows 200 --max_length 256   # the suite's smoke

The data: ultrachat-like multi-turn chats (~4,000 characters, 2-4 exchanges) written offline as `save_to_disk`
train/test splits, N rows and N/20. Both paths train the tiny model (its cost is negligible, so data preparation is
the whole cost) with the guide's flags (chatml, packing, --max_length as given, LoRA all-linear) for one step:
    ours       train.py: the row checks, the data report, one TRL preparation, shared by every rank
    upstream   the same rows and flags through TRL's SFTTrainer alone, as upstream's train.py hands them over
               (chat template applied by TRL, no checks, no report)
cold: the datasets cache, the cache files `datasets` writes beside the splits, and ours' prepared copy removed;
warm: a later launch on the same data (the median of --warm_rounds launches: a warm launch is a few seconds, which
these shared machines make noisy). Seconds to the first step: from the launch to the first logged loss
(the log line, read as it is printed). Peak RSS: the training process's own high-water mark (ru_maxrss of the
largest process of the launch), anonymous and file-backed pages together, as the kernel counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("model data train token batch layer memory gradient answer question explain because however example "
         "result value system method simple detail careful reason first second finally").split()


def chat(rng: random.Random, characters: int = 4000) -> list[dict]:
    """One ultrachat-like conversation: alternating user/assistant turns, assistant turns ~3x longer."""
    turns, total, role = [], 0, "user"
    while total < characters or role == "assistant":
        words = rng.randint(20, 60) if role == "user" else rng.randint(80, 200)
        text = " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."
        turns.append({"role": role, "content": text})
        total += len(text)
        role = "assistant" if role == "user" else "user"
    return turns


def build_data(root: Path, rows: int, seed: int = 0) -> Path:
    from datasets import Dataset

    rng = random.Random(seed)
    for split, n in (("train", rows), ("test", max(rows // 20, 2))):
        Dataset.from_dict({"messages": [chat(rng) for _ in range(n)]}).save_to_disk(str(root / split))
    return root


def clear_caches(data: Path, cache: Path, out: Path) -> None:
    """What a cold launch has not got: datasets' cache, the map caches beside the splits, a prepared copy."""
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    for split in data.iterdir():
        for f in split.glob("cache-*.arrow"):
            f.unlink()


FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
         "--lora_target_modules", "all-linear", "--chat_template_format", "chatml", "--packing", "True",
         "--per_device_train_batch_size", "1", "--max_steps", "1", "--logging_steps", "1", "--report_to", "none",
         "--eval_strategy", "no", "--save_strategy", "no", "--bf16", "False", "--seed", "7"]


def upstream(argv: list[str]) -> int:
    """Upstream's train.py, reduced to what it does with the data: splits read, tokenizer with the chat template,
    model, SFTTrainer(train_dataset=..., eval_dataset=...) preparing the rows itself."""
    sys.path.insert(0, str(REPO))
    import transformers
    from datasets import load_from_disk
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from sft_recipe.config.args import ModelArguments
    from sft_recipe.train.model import load_tokenizer

    parser = transformers.HfArgumentParser((SFTConfig,))
    model_path, data_path, rest = argv[0], argv[1], argv[2:]
    (args,) = parser.parse_args_into_dataclasses(rest)
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=model_path, chat_template_format="chatml"), False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path)
    model.resize_token_embeddings(len(tokenizer))
    train, test = (load_from_disk(str(Path(data_path) / s)) for s in ("train", "test"))
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=test, processing_class=tokenizer,
                         peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    trainer.train()
    return 0


PEAK_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
                "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); "
                "sys.exit(rc)")


def sft_flags() -> list[str]:
    """FLAGS minus the recipe's own (LoRA and chat-template flags: upstream's path gives them in code)."""
    recipe_only = {"--use_peft_lora", "--lora_r", "--lora_alpha", "--lora_dropout", "--lora_target_modules",
                   "--chat_template_format"}
    pairs = list(zip(FLAGS[::2], FLAGS[1::2]))
    return [x for flag, value in pairs if flag not in recipe_only for x in (flag, value)]


def launch(path: str, model: Path, data: Path, out: Path, cache: Path, max_length: int) -> dict:
    """One launch: seconds to the first logged loss, and the peak RSS of its largest process (a fresh wrapper
    process per launch, so RUSAGE_CHILDREN is this launch's alone)."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    if path == "ours":
        cmd = [sys.executable, str(REPO / "train.py"), "--model_name_or_path", str(model), "--dataset_name",
               str(data), "--output_dir", str(out), "--max_seq_len", str(max_length), "--overwrite_output_dir", "True",
               *FLAGS]
    else:
        cmd = [sys.executable, __file__, "--upstream", str(model), str(data), "--output_dir", str(out),
               "--max_length", str(max_length), *sft_flags()]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", PEAK_WRAPPER, *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    first_step, peak_kib, log = None, None, []
    for line in proc.stdout:
        log.append(line)
        if first_step is None and "'loss'" in line:
            first_step = time.perf_counter() - start
        if line.startswith("PEAK_RSS_KIB"):
            peak_kib = int(line.split()[1])
    proc.wait()
    if proc.returncode != 0 or first_step is None:
        raise SystemExit(f"{path} failed (exit {proc.returncode}):\n{''.join(log[-30:])}")
    return {"seconds": first_step, "peak_rss_mib": peak_kib / 1024, "log": "".join(log)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2000,10000,30000", help="comma-separated dataset sizes")
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--warm_rounds", type=int, default=3, help="warm launches per path (the median is shown)")
    parser.add_argument("--keep", default="", help="work here and keep it (default: a temporary folder)")
    parser.add_argument("--json", default="", help="also write the results here")
    args, rest = parser.parse_known_args()
    if rest[:1] == ["--upstream"]:
        return upstream(rest[1:])
    sys.path.insert(0, str(REPO))
    from sft_recipe.tiny import build_tiny

    root = Path(args.keep or tempfile.mkdtemp(prefix="data-prep-"))
    tiny = build_tiny(root / ".tiny")
    results = []
    print("| rows | path | cold s | warm s | cold peak RSS MiB | warm peak RSS MiB |\n|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        data = build_data(root / f"data-{rows}", rows)
        row = {"rows": rows}
        for path in ("upstream", "ours"):
            cache, out = root / f"cache-{path}", root / f"out-{path}"
            clear_caches(data, cache, out)
            cold = launch(path, tiny.model_dir, data, out, cache, args.max_length)
            warms = [launch(path, tiny.model_dir, data, out, cache, args.max_length) for _ in range(args.warm_rounds)]
            warm = sorted(warms, key=lambda w: w["seconds"])[len(warms) // 2]  # the median launch
            for phase, result in (("cold", cold), ("warm", warm)):
                (root / f"{path}-{rows}-{phase}.log").write_text(result["log"])
            row[path] = {"cold": {k: v for k, v in cold.items() if k != "log"},
                         "warm": {k: v for k, v in warm.items() if k != "log"}}
            print(f"| {rows:,} | {path} | {cold['seconds']:.1f} | {warm['seconds']:.1f} | "
                  f"{cold['peak_rss_mib']:.0f} | {warm['peak_rss_mib']:.0f} |", flush=True)
        for phase in ("cold", "warm"):
            row[f"{phase}_ratio"] = row["ours"][phase]["seconds"] / row["upstream"][phase]["seconds"]
        print(f"| {rows:,} | ours / upstream | {row['cold_ratio']:.2f}x | {row['warm_ratio']:.2f}x | | |", flush=True)
        results.append(row)
    if len(results) > 1:  # how peak RSS grows with the rows: MiB per 1,000 rows, first to last size
        first, last = results[0], results[-1]
        per_k = 1000 / (last["rows"] - first["rows"])
        for path in ("upstream", "ours"):
            slope = (last[path]["cold"]["peak_rss_mib"] - first[path]["cold"]["peak_rss_mib"]) * per_k
            print(f"\npeak RSS slope, {path}: {slope:.1f} MiB per 1,000 rows (cold)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
