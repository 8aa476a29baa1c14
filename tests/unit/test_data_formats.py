"""Every accepted format, in one process: recognised from its columns, converted once, and trained on exactly the
tokens it should be (labels from TRL's own SFTTrainer), with the EOS that ends an answer trained even when the
pad token is the EOS token (trl #1623). The data report's numbers and the preview are checked against the same."""

import json

import pytest
from datasets import Dataset

from sft_recipe.config.args import ConfigError, DataTrainingArguments, ModelArguments
from sft_recipe.data.formats import detect_format
from sft_recipe.data.prepare import prepare, prepare_for_trl, read_splits
from sft_recipe.data.report import LOSS_MARK, measure, preview, tokenize_like_trl
from sft_recipe.train.model import load_tokenizer

ANSWER_ONLY = "completion"  # trained text is the answer + EOS
EVERYTHING = "all"  # trained text is the whole rendered example
# format folder -> (format detected, what carries loss, extra flags)
FORMATS = {
    "messages": ("messages", EVERYTHING, {}),
    "sharegpt": ("sharegpt", EVERYTHING, {}),
    "sharegpt+assistant_only": ("sharegpt", ANSWER_ONLY, {"assistant_only_loss": True}),
    "alpaca": ("alpaca", ANSWER_ONLY, {}),
    "prompt_completion": ("prompt_completion", ANSWER_ONLY, {}),
    "prompt_completion_chat": ("prompt_completion", ANSWER_ONLY, {}),
}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    # chat_template_format none: the tiny tokenizer has no pad token, so the recipe pads with EOS (the #1623 case)
    tok = load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir)))
    assert tok.pad_token_id == tok.eos_token_id
    return tok


def _sft_config(tmp_path, **overrides):
    from trl import SFTConfig

    return SFTConfig(**{"output_dir": str(tmp_path), "bf16": False, "use_cpu": True, "report_to": "none",
                        "packing": False, "max_length": 256, **overrides})


def _prepared(folder, tokenizer, text_field="text", assistant_only_loss=False, **data_flags):
    data_args = DataTrainingArguments(dataset_name=str(folder), **data_flags)
    return prepare(read_splits(data_args), data_args, text_field, tokenizer, assistant_only_loss)


def _trainer(tiny, tokenizer, dataset, args):
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    return SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)


def _trained_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([int(i) for i, label in zip(ids, labels) if label != -100])


@pytest.mark.parametrize("case", list(FORMATS))
def test_each_format_trains_what_it_should(tiny, format_datasets, tokenizer, tmp_path, case):
    from sft_recipe.tiny import load_conversations

    fmt, trained, flags = FORMATS[case]
    data = _prepared(format_datasets[case.split("+")[0]], tokenizer, **flags)
    assert data.formats == {"train": fmt, "test": fmt}
    assert f"format '{fmt}' detected" in data.notes[0]
    trainer = _trainer(tiny, tokenizer, data.datasets["train"], _sft_config(tmp_path, **flags))
    conversations = load_conversations(tiny, "train")
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    for row in range(3):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        answer = conversations[row][-1]["content"]
        text = _trained_text(tokenizer, ids, labels)
        if trained == ANSWER_ONLY:
            assert text.strip() == f"{answer}</s>"
        else:  # every real token, the padding excluded
            real = int(batch["attention_mask"][row].sum())
            assert text == tokenizer.decode(ids[:real]) and answer in text
        assert conversations[row][-2]["content"] in tokenizer.decode(ids)  # the prompt is there either way
    # The report tokenizes with TRL's own preparation: the same labels as the trainer's.
    ours = tokenize_like_trl(data.datasets["train"].select(range(3)), tokenizer, trainer.args)
    assert ours["labels"] == trainer.train_dataset.select(range(3))["labels"]


@pytest.mark.parametrize("case", ["messages", "sharegpt+assistant_only", "prompt_completion", "alpaca"])
def test_eos_ending_each_answer_carries_loss_although_pad_is_eos(tiny, format_datasets, tokenizer, tmp_path, case):
    """trl #1623: padding with EOS must not mask the EOS that ends an answer, or the model never learns to stop."""
    _, _, flags = FORMATS[case]
    data = _prepared(format_datasets[case.split("+")[0]], tokenizer, **flags)
    trainer = _trainer(tiny, tokenizer, data.datasets["train"], _sft_config(tmp_path, **flags))
    rows = [trainer.train_dataset[i] for i in range(8)]
    assert len({len(r["input_ids"]) for r in rows}) > 1  # different lengths: the batch is padded
    batch = trainer.data_collator(rows)
    eos = tokenizer.eos_token_id
    for row in range(len(rows)):
        ids, labels, mask = batch["input_ids"][row], batch["labels"][row], batch["attention_mask"][row]
        last = int(mask.sum()) - 1
        assert ids[last] == eos and labels[last] == eos  # the answer's EOS is trained
        assert all(labels[k] == -100 for k in range(last + 1, len(ids)))  # the EOS used as padding is not
        assert all(ids[k] == eos for k in range(last + 1, len(ids)))
    report = measure(data, tokenizer, trainer.args)
    assert report.splits["train"].eos_with_loss_share == 1.0


def test_detection_needs_no_flag_and_ambiguity_asks_for_one():
    assert detect_format(["messages", "prompt", "prompt_id"], "train", "text")[0] == "messages"  # ultrachat_200k
    assert detect_format(["content"], "train", "content")[0] == "text"
    assert detect_format(["instruction", "input", "output"], "train", "text")[0] == "alpaca"
    fmt, note = detect_format(["messages", "content"], "train", "content")
    assert fmt == "messages" and "text column `content` ignored" in note
    with pytest.raises(ConfigError, match=r"fit several formats \(messages, sharegpt\).*--dataset_format messages"):
        detect_format(["messages", "conversations"], "train", "text")
    assert detect_format(["messages", "conversations"], "train", "text", "sharegpt")[0] == "sharegpt"
    with pytest.raises(ConfigError, match=r"--dataset_format alpaca: split 'train' has no column\(s\) \['output'\]"):
        detect_format(["instruction", "response"], "train", "text", "alpaca")


def test_column_and_role_maps_rename_before_detection(tmp_path, tokenizer):
    rows = [{"dialog": [{"speaker": "bot", "from": "client", "value": "hi"}, {"from": "bot", "value": "hello"}]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    data = _prepared(tmp_path, tokenizer, splits="train", dataset_column_map="dialog=conversations",
                     dataset_role_map="client=user,bot=assistant")
    assert data.formats["train"] == "sharegpt"
    turns = data.datasets["train"][0]["messages"]
    assert [(t["role"], t["content"]) for t in turns] == [("user", "hi"), ("assistant", "hello")]
    assert turns[0]["speaker"] == "bot"  # other keys of a message are kept
    with pytest.raises(ConfigError, match=r"dataset_column_map talk=conversations: split 'train' has no column 'talk'"):
        _prepared(tmp_path, tokenizer, splits="train", dataset_column_map="talk=conversations")
    with pytest.raises(ConfigError, match=r"'robot' is not a role the chat templates know"):
        _prepared(tmp_path, tokenizer, splits="train", dataset_column_map="dialog=conversations",
                  dataset_role_map="bot=robot")
    with pytest.raises(ConfigError, match=r"entry 'bot' is not `name=new_name`"):
        _prepared(tmp_path, tokenizer, splits="train", dataset_role_map="bot")


def test_assistant_only_loss_refused_for_standard_prompt_completion(format_datasets, tokenizer):
    with pytest.raises(ConfigError, match=r"needs `messages` rows or another conversational format.*prompt_completion"):
        _prepared(format_datasets["prompt_completion"], tokenizer, assistant_only_loss=True)


def test_report_counts_what_the_trainer_trains(tiny, format_datasets, tokenizer, tmp_path):
    data = _prepared(format_datasets["alpaca"], tokenizer)
    args = _sft_config(tmp_path)
    report = measure(data, tokenizer, args)
    train = report.splits["train"]
    trainer = _trainer(tiny, tokenizer, data.datasets["train"], args)
    labels = [label for row in trainer.train_dataset["labels"] for label in row]
    assert train.rows == train.rows_read == len(trainer.train_dataset) and train.rows_dropped == 0
    assert (train.tokens_trained, train.loss_tokens) == (len(labels), sum(label != -100 for label in labels))
    assert 0.1 < train.loss_token_share < 0.6  # the answers, not the prompts
    assert train.tokens_min <= train.tokens_median <= train.tokens_max and train.examples_cut_share == 0
    assert report.warnings == [] and train.packed_rows is None
    saved = json.loads(report.to_json())
    assert set(saved["splits"]["train"]) >= {"rows", "tokens_median", "tokens_cut_share", "loss_token_share"}


def test_short_max_length_warns_and_packing_is_measured(format_datasets, tokenizer, tmp_path):
    data = _prepared(format_datasets["messages"], tokenizer)
    cut = measure(data, tokenizer, _sft_config(tmp_path, max_length=8)).splits["train"]
    whole = measure(data, tokenizer, _sft_config(tmp_path)).splits["train"]
    assert cut.examples_cut_share == 1.0 and cut.tokens_trained == 8 * cut.rows
    assert cut.tokens_cut_share == pytest.approx(1 - 8 * cut.rows / whole.tokens_total)
    report = measure(data, tokenizer, _sft_config(tmp_path, max_length=8))
    assert any("100% of the train examples are longer than max_length 8" in w and "--max_seq_len" in w
               for w in report.warnings)
    assert "WARNING: 100% of the train examples" in report.render()
    packed = measure(data, tokenizer, _sft_config(tmp_path, packing=True, max_length=128)).splits["train"]
    assert packed.packed_rows < packed.rows and packed.tokens_trained == whole.tokens_total
    assert packed.packing_efficiency == pytest.approx(whole.tokens_total / (packed.packed_rows * 128))


def test_preview_marks_exactly_the_trained_text(tiny, format_datasets, tokenizer, tmp_path):
    from sft_recipe.tiny import load_conversations

    data = _prepared(format_datasets["prompt_completion_chat"], tokenizer)
    shown = preview(data, tokenizer, _sft_config(tmp_path), 2)
    first = load_conversations(tiny, "train")[0]
    assert shown.count("=== train example") == 2
    assert f"{LOSS_MARK[0]}{first[-1]['content']}</s>{LOSS_MARK[1]}" in shown
    prompt = shown.split(f"{LOSS_MARK[0]}{first[-1]['content']}")[0].split("===")[-1]
    assert first[-2]["content"] in prompt and LOSS_MARK[0] not in prompt  # the prompt is shown, without loss
    cut = preview(data, tokenizer, _sft_config(tmp_path, max_length=8), 1)
    header, body = cut.split("===\n", 1)
    assert "cut at max_length 8" in body and LOSS_MARK[0] not in body  # the answer lies beyond the cut
    assert "0 trained with loss" in header and "TRL drops this example" in header


def test_text_rows_unchanged_and_hub_style_splits_kept(tiny, tokenizer):
    data_args = DataTrainingArguments(dataset_name=str(tiny.text_dir))
    data = prepare(read_splits(data_args), data_args, "content", tokenizer)
    assert data.formats == {"train": "text", "test": "text"}
    assert data.datasets["train"].column_names == ["content"]
    plain = prepare_for_trl({"train": Dataset.from_list([{"content": "hello"}])}, data_args, "content", tokenizer)
    assert plain["train"]["content"] == ["hello"]


def test_one_note_for_splits_of_one_format_and_a_negative_preview_refused(format_datasets, tokenizer):
    data = _prepared(format_datasets["sharegpt"], tokenizer)
    assert data.notes == ["data: splits train, test: format 'sharegpt' detected from `conversations` -> `messages` "
                          "(from/value -> role/content, roles mapped): TRL applies the chat template."]
    with pytest.raises(ConfigError, match=r"--preview_examples -1: give a number of examples"):
        _prepared(format_datasets["sharegpt"], tokenizer, preview_examples=-1)
