"""Load a saved adapter the way users do and compare it with its base model on held-out chat prompts.

    python -m sft_recipe.evaluate --adapter_dir runs/demo --dataset_name .tiny/data/jsonl --split test

Loads the base named in adapter_config.json (unsharded, one process, fp32), sizes its embeddings to the saved
tokenizer, attaches the adapter with `PeftModel.from_pretrained`, and scores the same prompts with the adapter
disabled ("base") and enabled ("adapter"): teacher-forced answer-token accuracy, exact match of greedy answers, and
a few samples side by side. Writes `eval_before_after.json` into the adapter folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def load_base_and_adapter(adapter_dir: str, trust_remote_code: bool = False):
    """(PeftModel on an fp32 base, tokenizer) from a saved adapter folder, exactly as a user would load them."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_name = PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if len(tokenizer) != base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # the adapter carries the trained rows
    return PeftModel.from_pretrained(base, adapter_dir), tokenizer


def compare(adapter_dir: str, conversations: list, max_new_tokens: int = 24) -> dict:
    from sft_recipe.scoring import score_answers

    model, tokenizer = load_base_and_adapter(adapter_dir)
    with model.disable_adapter():
        before = score_answers(model, tokenizer, conversations, max_new_tokens=max_new_tokens)
    after = score_answers(model, tokenizer, conversations, max_new_tokens=max_new_tokens)
    return {"base": before, "adapter": after}


def _print_report(result: dict, samples: int) -> None:
    before, after = result["base"], result["adapter"]
    print(f"{'held-out prompts':<28}{'base':>10}{'adapter':>10}")
    for metric in ("answer_token_accuracy", "exact_match"):
        print(f"{metric:<28}{before[metric]:>10.3f}{after[metric]:>10.3f}")
    for (prompt, reference, base_answer), (_, _, adapter_answer) in list(
            zip(before["samples"], after["samples"]))[:samples]:
        question = prompt.strip().splitlines()[-2] if prompt.strip().count("\n") else prompt.strip()
        print(f"\nQ: {question}\n  reference: {reference}\n  base:      {base_answer!r}\n"
              f"  adapter:   {adapter_answer!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter_dir", required=True)
    parser.add_argument("--dataset_name", required=True, help="one source, in any form train.py's --dataset_name takes")
    parser.add_argument("--split", default="test")
    parser.add_argument("--max_examples", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="how many answers to print side by side")
    parser.add_argument("--fail_if_not_better", action="store_true",
                        help="exit 1 unless the adapter's answer-token accuracy beats the base model's")
    args = parser.parse_args(argv)

    from sft_recipe.config.args import DataTrainingArguments
    from sft_recipe.data.prepare import MESSAGES, load_splits, split_role
    from sft_recipe.errors import ConfigError

    try:
        datasets = load_splits(DataTrainingArguments(dataset_name=args.dataset_name, splits=args.split))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dataset = datasets[split_role(args.split)]
    if MESSAGES not in dataset.column_names:
        print(f"error: split '{args.split}' has no `messages` column to build prompts from.", file=sys.stderr)
        return 2
    conversations = dataset[MESSAGES][: args.max_examples]
    result = compare(args.adapter_dir, conversations)
    _print_report(result, args.samples)
    with open(os.path.join(args.adapter_dir, "eval_before_after.json"), "w") as f:
        json.dump({side: {k: v for k, v in r.items() if k != "samples"} | {"samples": r["samples"][:args.samples]}
                   for side, r in result.items()}, f, indent=2)
    gain = result["adapter"]["answer_token_accuracy"] - result["base"]["answer_token_accuracy"]
    if args.fail_if_not_better and gain <= 0:
        print(f"error: the adapter is not better than its base on held-out prompts (gain {gain:+.3f}).",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
