"""Every bad row is caught before any weight is loaded, named by file and line (or split and row), with the fix;
all problems at once (capped, with a count); or dropped with --drop_bad_rows, the count reported."""

import json
import logging

import pytest
from datasets import Dataset

from sft_recipe.config.args import ConfigError, DataTrainingArguments, ModelArguments
from sft_recipe.data.checks import MAX_LISTED
from sft_recipe.data.prepare import prepare, read_splits
from sft_recipe.train.model import load_tokenizer


def _turns(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


GOOD = {"messages": _turns(("user", "What is the opposite of hot?"), ("assistant", "The opposite of hot is cold."))}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(ModelArguments(model_name_or_path=str(tiny.model_dir)))


def _write(folder, rows, name="train.jsonl"):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (folder / name).write_text("".join(line + "\n" for line in lines))
    return folder


def _problems(folder, tokenizer, assistant_only_loss=False, **flags) -> list[str]:
    data_args = DataTrainingArguments(dataset_name=str(folder), splits="train", **flags)
    with pytest.raises(ConfigError) as e:
        prepare(read_splits(data_args), data_args, "text", tokenizer, assistant_only_loss)
    return e.value.problems


def test_empty_null_and_numeric_content_named_by_line(tmp_path, tokenizer):
    rows = [GOOD, GOOD, {"messages": []}, "", GOOD,
            {"messages": _turns(("user", None), ("assistant", "x"))},
            {"messages": _turns(("user", 5), ("assistant", "x"))},
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}]
    problems = _problems(_write(tmp_path, rows), tokenizer)
    path = tmp_path / "train.jsonl"
    assert problems[0] == f"{path} line 3: `messages` is an empty conversation"
    # line 4 is blank (no row); the line numbers are the file's
    assert problems[1] == f"{path} line 6: `messages` message 1 has `content` null; it must be a string"
    assert problems[2] == f"{path} line 7: `messages` message 1 has `content` a number (5); it must be a string"
    assert problems[3] == f"{path} line 8: `messages` message 1 has no `content`"
    assert problems[-1].startswith("4 bad row(s) of 7. Fix: correct the rows; or --drop_bad_rows True")


def test_unknown_roles_list_the_known_ones_and_suggest_a_role_map(tmp_path, tokenizer):
    rows = [GOOD, {"messages": _turns(("human", "hi"), ("gpt", "hello"))}]
    problems = _problems(_write(tmp_path, rows), tokenizer)
    assert "line 2: `messages` message 1 has the unknown role 'human' (known: assistant, system, tool, user)" in \
        problems[0]
    assert "message 2 has the unknown role 'gpt'" in problems[0]
    assert "--dataset_role_map gpt=assistant,human=user" in problems[-1]
    data_args = DataTrainingArguments(dataset_name=str(tmp_path), splits="train",
                                      dataset_role_map="human=user,gpt=assistant")
    fixed = prepare(read_splits(data_args), data_args, "text", tokenizer).datasets["train"]
    assert [t["role"] for t in fixed[1]["messages"]] == ["user", "assistant"]


def test_conversation_without_final_assistant_turn_where_the_loss_needs_one(tmp_path, tokenizer):
    ends_with_user = {"messages": _turns(("user", "a"), ("assistant", "b"), ("user", "c"))}
    problems = _problems(_write(tmp_path / "m", [GOOD, ends_with_user]), tokenizer, assistant_only_loss=True)
    assert "line 2: the conversation ends with a 'user' turn, not an assistant one: with --assistant_only_loss" \
        in problems[0]
    chat_pc = [{"prompt": _turns(("user", "a")), "completion": _turns(("user", "b"))}]
    problems = _problems(_write(tmp_path / "pc", chat_pc), tokenizer)
    assert "line 1: the completion ends with a 'user' turn, not an assistant one" in problems[0]


def test_template_errors_and_empty_renderings(tmp_path, tokenizer):
    # The tiny template raises on roles it does not know, "tool" among them.
    problems = _problems(_write(tmp_path / "a", [GOOD, {"messages": _turns(("tool", "42"), ("assistant", "x"))}]),
                         tokenizer)
    assert "line 2: the chat template fails on it (TemplateError: Unknown role: tool)" in problems[0]
    blank = {"messages": _turns(("user", ""), ("assistant", ""))}
    original = tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        problems = _problems(_write(tmp_path / "b", [GOOD, blank]), tokenizer)
    finally:
        tokenizer.chat_template = original
    assert problems[0].endswith("line 2: the chat template renders it to nothing")
    problems = _problems(_write(tmp_path / "c", [{"text": "fine"}, {"text": "  "}, {"text": None}]), tokenizer)
    assert problems[0].endswith("line 2: `text` is empty: nothing to train on")
    assert problems[1].endswith("line 3: `text` is null; it must be a string")


def test_malformed_json_lines_listed_with_the_other_problems(tmp_path, tokenizer):
    rows = [GOOD, '{"messages": [', GOOD, "[1, 2]", {"messages": []}]
    problems = _problems(_write(tmp_path, rows), tokenizer)
    path = tmp_path / "train.jsonl"
    assert problems[0].startswith(f"{path} line 2: not valid JSON (")
    assert problems[1] == f"{path} line 4: a JSON list, not an object of columns"
    assert problems[2] == f"{path} line 5: `messages` is an empty conversation"
    assert problems[-1].startswith("3 bad row(s) of 5.")


def test_alpaca_and_prompt_completion_rows(tmp_path, tokenizer):
    alpaca = [{"instruction": "Name a colour.", "input": "", "output": "Red."},
              {"instruction": "", "input": None, "output": None}, {"instruction": "x", "input": 3, "output": "y"}]
    problems = _problems(_write(tmp_path / "a", alpaca), tokenizer)
    assert problems[0].endswith("line 2: `output` is null; it must be a string; `instruction` is empty")
    assert problems[1].endswith("line 3: `input` is a number (3); it must be a string or absent")
    mixed = [{"prompt": "Q: hot?", "completion": " cold"}, {"prompt": _turns(("user", "x")), "completion": "y"},
             {"prompt": "Q", "completion": ""}]
    problems = _problems(_write(tmp_path / "pc", mixed), tokenizer)
    assert "line 2: `prompt` is a list" in problems[0]
    assert "prompt/completion are strings (its first row)" in problems[0]
    assert problems[1].endswith("line 3: `completion` is empty: nothing to train on")


def test_all_problems_counted_but_the_list_capped(tmp_path, tokenizer):
    rows = [GOOD] + [{"messages": []}] * (MAX_LISTED + 7)
    problems = _problems(_write(tmp_path, rows), tokenizer)
    assert len(problems) == MAX_LISTED + 2
    assert problems[MAX_LISTED] == "... and 7 more problem(s) not listed"
    assert problems[-1].startswith(f"{MAX_LISTED + 7} bad row(s) of {MAX_LISTED + 8}.")


def test_rows_of_save_to_disk_splits_are_named_by_split_and_row(tmp_path, tokenizer):
    Dataset.from_list([GOOD, {"messages": _turns(("user", "a"), ("assistant", None))}]).save_to_disk(
        str(tmp_path / "train"))
    problems = _problems(tmp_path, tokenizer)
    assert problems[0] == (f"{tmp_path} split 'train' row 2: `messages` message 2 has `content` null; "
                           "it must be a string")


def test_drop_bad_rows_reports_the_count(tmp_path, tokenizer, caplog):
    rows = [GOOD, {"messages": []}, "{oops", GOOD, {"messages": _turns(("bot", "x"))}]
    data_args = DataTrainingArguments(dataset_name=str(_write(tmp_path, rows)), splits="train", drop_bad_rows=True)
    with caplog.at_level(logging.WARNING):
        data = prepare(read_splits(data_args), data_args, "text", tokenizer)
    assert len(data.datasets["train"]) == 2 and data.rows_dropped == {"train": 3} and data.rows_read == {"train": 5}
    assert "--drop_bad_rows: dropped 3 of 5 rows of split 'train'" in caplog.text
    all_bad = DataTrainingArguments(dataset_name=str(_write(tmp_path / "bad", [{"messages": []}])), splits="train",
                                    drop_bad_rows=True)
    with pytest.raises(ConfigError, match="every row is bad"):
        prepare(read_splits(all_bad), all_bad, "text", tokenizer)
