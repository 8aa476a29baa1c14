"""--assistant_only_loss True: only the assistant turns (and their end-of-turn token) carry a label."""

import pytest
from datasets import Dataset

from sft_recipe.config.args import ConfigError, DataTrainingArguments, ModelArguments
from sft_recipe.data.prepare import load_splits, prepare_for_trl
from sft_recipe.train.model import fit_embeddings_to_tokenizer, load_tokenizer

CONVERSATION = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the opposite of hot?"},
                {"role": "assistant", "content": "The opposite of hot is cold."}]


@pytest.mark.parametrize("fmt,end_of_turn", [("chatml", "<|im_end|>"), ("zephyr", "</s>"), ("none", "</s>")])
def test_labels_cover_exactly_the_assistant_answer(tiny, tmp_path, fmt, end_of_turn):
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format=fmt))
    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    fit_embeddings_to_tokenizer(model, tokenizer)
    trainer = SFTTrainer(model=model, processing_class=tokenizer,
                         train_dataset=Dataset.from_list([{"messages": CONVERSATION}] * 2),
                         args=SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, bf16=False, use_cpu=True,
                                        report_to="none", packing=False, max_length=128))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    trained = tokenizer.decode([int(i) for i, label in zip(ids, labels) if label != -100])
    assert trained.strip() == f"The opposite of hot is cold.{end_of_turn}"
    assert "What is the opposite" in tokenizer.decode(ids)  # the prompt is there, just not trained on


def test_refused_for_text_data_and_for_templates_without_generation_markers(tiny, tmp_path):
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir), chat_template_format="chatml"))
    text = load_splits(DataTrainingArguments(dataset_name=str(tiny.text_dir), splits="train"))
    with pytest.raises(ConfigError, match="needs `messages` rows"):
        prepare_for_trl(text, DataTrainingArguments(), "content", tokenizer, assistant_only_loss=True)
    chat = load_splits(DataTrainingArguments(dataset_name=str(tiny.jsonl_dir), splits="train"))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="no {% generation %} markers"):
        prepare_for_trl(chat, DataTrainingArguments(), "content", tokenizer, assistant_only_loss=True)
