"""utils.py keeps upstream's helper names working for forks that call them."""

from __future__ import annotations

import utils  # beside train.py at the repository root, as upstream's is
from sft_recipe.config.args import parse_args


def test_upstream_helpers_build_the_model_config_and_datasets(tiny, tmp_path):
    model_args, data_args, _, training_args = parse_args(
        ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), "--use_peft_lora", "True",
         "--lora_r", "4", "--output_dir", str(tmp_path)])
    model, peft_config, tokenizer = utils.create_and_prepare_model(model_args, data_args, training_args)
    assert peft_config.r == 4 and model.get_input_embeddings().num_embeddings >= len(tokenizer)
    train, test = utils.create_datasets(tokenizer, data_args, training_args)
    assert len(train) > 0 and len(test) > 0 and "messages" in train.column_names
