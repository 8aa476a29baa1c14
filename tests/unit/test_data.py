"""Dataset discovery (save_to_disk per split, DatasetDict, files, Hub names) and column checks."""

import json

import pytest
from datasets import Dataset, DatasetDict

from sft_recipe.config.args import ConfigError, DataTrainingArguments
from sft_recipe.data.prepare import load_splits, locate_splits, prepare_for_trl

ROWS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(6)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class FakeTokenizer:
    bos_token = "<s>"
    chat_template = "{{ messages }}"


def test_files_named_after_splits(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS[:4])
    Dataset.from_list(ROWS[4:]).to_parquet(str(tmp_path / "test.parquet"))
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path)))
    assert set(ds) == {"train", "test"} and len(ds["train"]) == 4 and len(ds["test"]) == 2
    assert ds["test"][0]["messages"][0]["content"] == "q4"


def test_save_to_disk_folder_per_split_as_upstream(tmp_path):
    Dataset.from_list(ROWS[:5]).save_to_disk(str(tmp_path / "train"))
    Dataset.from_list(ROWS[5:]).save_to_disk(str(tmp_path / "test"))
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path)))
    assert len(ds["train"]) == 5 and len(ds["test"]) == 1


def test_save_to_disk_dataset_dict(tmp_path):
    DatasetDict({"train": Dataset.from_list(ROWS[:3]), "test": Dataset.from_list(ROWS[3:])}).save_to_disk(
        str(tmp_path / "dd"))
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path / "dd")))
    assert len(ds["train"]) == 3 and len(ds["test"]) == 3


def test_only_train_split(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path), splits="train"))
    assert set(ds) == {"train"}


def test_missing_split_and_bad_split_name_are_both_reported(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _, problems = locate_splits(DataTrainingArguments(dataset_name=str(tmp_path), splits="train,test,dev"))
    text = "\n".join(problems)
    assert "no split 'test'" in text and "found: ['train.jsonl']" in text
    assert "split 'dev' is neither a train split nor a test split" in text


def test_missing_local_path_and_hub_name(tmp_path):
    _, problems = locate_splits(DataTrainingArguments(dataset_name=str(tmp_path / "nope")))
    assert "no such file or folder" in problems[0]
    sources, problems = locate_splits(DataTrainingArguments(dataset_name="smangrul/ultrachat-10k-chatml"))
    assert not problems and sources["train"] == ("hub", "smangrul/ultrachat-10k-chatml")


def test_text_column_missing_lists_columns(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "x", "answer": "y"}])
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path), splits="train"))
    with pytest.raises(ConfigError, match=r"neither a `messages` column nor the text column `content`.*'answer'"):
        prepare_for_trl(ds, DataTrainingArguments(), "content", FakeTokenizer())


def test_messages_without_chat_template_says_how_to_fix(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path), splits="train"))
    tok = FakeTokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="--chat_template_format chatml"):
        prepare_for_trl(ds, DataTrainingArguments(), "content", tok)


def test_text_rows_keep_only_text_and_get_bos_when_asked(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [{"content": "hello", "id": 1}, {"content": "<s>already", "id": 2}])
    ds = load_splits(DataTrainingArguments(dataset_name=str(tmp_path), splits="train"))
    out = prepare_for_trl(ds, DataTrainingArguments(add_special_tokens=True), "content", FakeTokenizer())
    assert out["train"].column_names == ["content"]
    assert out["train"]["content"] == ["<s>hello", "<s>already"]
    plain = prepare_for_trl(ds, DataTrainingArguments(add_special_tokens=False), "content", FakeTokenizer())
    assert plain["train"]["content"] == ["hello", "<s>already"]


def test_upstream_flags_that_do_nothing_say_so():
    from sft_recipe.data.prepare import dataset_flag_notes

    text = dataset_flag_notes(DataTrainingArguments(append_concat_token=False, add_special_tokens=True), False)
    assert text == ["--append_concat_token False has no effect: TRL 1.16 ends every text example with EOS (the "
                    "separator packing relies on)."]
    notes = dataset_flag_notes(DataTrainingArguments(append_concat_token=False, add_special_tokens=True), True)
    assert notes == ["--add_special_tokens True has no effect on `messages` data: the chat template decides the "
                     "special tokens."]  # and nothing about EOS: the chat template ends each row
    assert dataset_flag_notes(DataTrainingArguments(append_concat_token=True, add_special_tokens=True), False) == []
