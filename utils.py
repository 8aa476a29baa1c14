"""Upstream's helper names, kept for people who forked `examples/sft` and call them from their own scripts.

They are thin: the work lives in the `sft_recipe` package, which `train.py` uses directly.
"""

from __future__ import annotations

from sft_recipe.config.launch_env import read_launch_env
from sft_recipe.data.prepare import prepare, read_splits
from sft_recipe.train.model import added_token_ids, load_model, load_tokenizer, lora_config


def create_and_prepare_model(args, data_args, training_args):
    """Return (model, peft_config, tokenizer) as upstream does: the model sized to the tokenizer, LoRA config or None.

    `args` is a `sft_recipe.config.args.ModelArguments`; `data_args` is unused and kept for the signature.
    """
    del data_args
    tokenizer = load_tokenizer(args, training_args.trust_remote_code)
    model = load_model(args, training_args, tokenizer, read_launch_env())  # the launcher decides who reads weights
    new_token_ids = added_token_ids(args, tokenizer, training_args.trust_remote_code)
    return model, lora_config(args, new_token_ids, training_args.trust_remote_code), tokenizer


def create_datasets(tokenizer, data_args, training_args, apply_chat_template=False):
    """Return (train_data, eval_data). Rows in `messages` form stay conversational for TRL to template.

    `apply_chat_template` is accepted for upstream callers; the tokenizer's chat template is applied by TRL whenever
    the data holds `messages`.
    """
    del apply_chat_template
    datasets = prepare(read_splits(data_args), data_args, training_args.dataset_text_field, tokenizer).datasets
    return datasets["train"], datasets.get("test")
