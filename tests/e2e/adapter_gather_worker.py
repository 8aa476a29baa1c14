"""One rank of tests/e2e/test_adapter_gather.py: the adapter-only gather against upstream's full gather.

Launched by the test, never by hand in normal use:
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp_config.yaml \
        tests/e2e/adapter_gather_worker.py --model_dir .tiny/model --out_dir /tmp/gather --combos lora,qlora-chatml

For each combo (LoRA or QLoRA, with or without a chatml vocabulary resize) it builds the trainer as train.py does,
trains two steps, then gathers the adapter both ways on every rank:
- ours: `gather.gather_adapter_state` over the keys chosen before wrapping;
- upstream's: every weight unsharded onto rank 0 (`compat.gather_full_state_dict`, FULL_STATE_DICT), then PEFT's
  selection -- what `trainer.save_model()` does after `set_state_dict_type("FULL_STATE_DICT")`.
Rank 0 writes <out_dir>/<combo>.json: the selected keys of both, whether every tensor is byte-identical, and each
gather's added anonymous RSS per rank (meaningful when launched with MALLOC_MMAP_THRESHOLD_, see report.RssWatch).
It asserts nothing itself, so one run reports every fact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

COMBOS = {
    "lora": [],
    "lora-chatml": ["--chat_template_format", "chatml"],
    "qlora": ["--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16",
              "--bnb_4bit_compute_dtype", "float32", "--bf16", "True"],
}
COMBOS["qlora-chatml"] = COMBOS["qlora"] + COMBOS["lora-chatml"]
FLAGS = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--max_steps", "2", "--per_device_train_batch_size", "2",
         "--learning_rate", "1e-2", "--max_seq_len", "32", "--report_to", "none", "--save_strategy", "no",
         "--eval_strategy", "no", "--seed", "3", "--dataset_text_field", "text", "--packing", "False"]


def run_combo(name: str, model_dir: str, out_dir: Path, extra: list[str], launch, label: str | None = None) -> None:
    import torch
    from datasets import Dataset
    from peft import get_peft_model_state_dict

    from sft_recipe import compat
    from sft_recipe.artifacts.gather import gather_adapter_state
    from sft_recipe.config.args import parse_args
    from sft_recipe.measure import RssWatch
    from sft_recipe.train.model import load_model, load_tokenizer, lora_config
    from sft_recipe.train.trainer import RecipeSFTTrainer

    argv = ["--model_name_or_path", model_dir, "--output_dir", str(out_dir / (label or name)), *FLAGS, *COMBOS[name],
            *extra]
    model_args, _, _, training_args = parse_args(argv)
    tokenizer = load_tokenizer(model_args)
    texts = [f"fact {i}: the value of item {i} is {i * 7 % 13}." for i in range(16)]
    model = load_model(model_args, training_args, tokenizer, launch)
    trainer = RecipeSFTTrainer(model=model, args=training_args, train_dataset=Dataset.from_dict({"text": texts}),
                               processing_class=tokenizer, peft_config=lora_config(model_args, []))
    trainer.train()
    accelerator = trainer.accelerator
    with RssWatch() as ours_watch:
        ours = gather_adapter_state(accelerator, trainer.model_wrapped, trainer.adapter_keys)
    accelerator.wait_for_everyone()
    with RssWatch() as full_watch:
        full = compat.gather_full_state_dict(accelerator, trainer.model_wrapped)
    costs = torch.tensor([ours_watch.added_mib, full_watch.added_mib, ours_watch.seconds, full_watch.seconds],
                         dtype=torch.float64)
    costs = accelerator.gather(costs).reshape(-1, 4) if accelerator.num_processes > 1 else costs[None]
    if not accelerator.is_main_process:
        return
    peft_model = accelerator.unwrap_model(trainer.model)
    with compat.module_names_without_fsdp_segments(peft_model):
        saved_ours = get_peft_model_state_dict(peft_model, state_dict=ours)
        saved_full = get_peft_model_state_dict(peft_model, state_dict=full)
    identical = sorted(k for k in saved_ours.keys() & saved_full.keys()
                       if saved_ours[k].dtype == saved_full[k].dtype and saved_ours[k].shape == saved_full[k].shape
                       and torch.equal(saved_ours[k].contiguous().view(torch.uint8),
                                       saved_full[k].contiguous().view(torch.uint8)))
    facts = {
        "combo": label or name, "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "num_processes": accelerator.num_processes,
        "keys_ours": sorted(saved_ours), "keys_full": sorted(saved_full), "identical": identical,
        "gathered_keys": len(ours), "full_keys": len(full),
        "embedding_keys": sorted(k for k in saved_ours if "embed_tokens" in k or "lm_head" in k),
        "lora_b_nonzero": sum(bool(v.any()) for k, v in saved_ours.items() if "lora_B" in k),
        "adapter_mib": sum(v.numel() * v.element_size() for v in saved_ours.values()) / 2**20,
        "full_mib": sum(v.numel() * v.element_size() for v in full.values()) / 2**20,
        "ours_added_mib_per_rank": [round(float(x), 1) for x in costs[:, 0]],
        "full_added_mib_per_rank": [round(float(x), 1) for x in costs[:, 1]],
        "ours_seconds": round(float(costs[:, 2].max()), 3), "full_seconds": round(float(costs[:, 3].max()), 3),
    }
    (out_dir / f"{label or name}.json").write_text(json.dumps(facts, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--combos", default=",".join(COMBOS))
    parser.add_argument("--big_model_dir", default=None,
                        help="also run lora-chatml on this (larger) model, written as big-lora-chatml.json")
    args, extra = parser.parse_known_args()

    from sft_recipe.startup import freeze_imports, prepare_tool_imports

    prepare_tool_imports()  # as train.py (sft_recipe/startup.py): no cyclic collector, the models scan cached
    from sft_recipe.compat.deepspeed_cpu import skip_cpu_inference_op_build
    from sft_recipe.compat.unused_imports import skip_unused_deepspeed, skip_unused_mlflow, skip_unused_wandb
    from sft_recipe.config.launch_env import may_use_deepspeed, read_launch_env

    skip_unused_wandb()  # as train.py keeps out what a run does not use: it reports to none
    skip_unused_mlflow()
    if not may_use_deepspeed():  # and DeepSpeed off its own launch
        skip_unused_deepspeed()
    else:  # and on it, builds no DeepSpeed CPU inference op
        skip_cpu_inference_op_build()
    import sft_recipe.train.trainer  # noqa: F401  (TRL, transformers' trainer, PEFT: imported while it pauses)
    from sft_recipe import compat

    freeze_imports()

    launch = read_launch_env()
    compat.install(launch)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.combos.split(","):
        run_combo(name, args.model_dir, out_dir, extra, launch)
    if args.big_model_dir:
        run_combo("lora-chatml", args.big_model_dir, out_dir, extra, launch, label="big-lora-chatml")
    import torch.distributed as dist

    if dist.is_initialized():  # as train.py: gloo's threads can abort a finished rank at interpreter teardown
        dist.destroy_process_group()
    compat.exit_skipping_teardown(0, launch.world_size)


if __name__ == "__main__":
    main()
