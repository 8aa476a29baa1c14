"""Several datasets in one run (sft_recipe/data/mixture.py): `--dataset_name a,b --dataset_proportions 0.8,0.2`, or
TRL's `datasets:` list in a recipe YAML. Each source is checked as a single dataset is; the shares follow TRL's rule
(normalised, no row repeated); the rows taken and their order come from the seed; the data report names each
source; what cannot be mixed is refused before any weight, naming the sources."""

from __future__ import annotations

import json

import pytest

from sft_recipe.config.args import ConfigError, parse_args, read_recipe_yaml
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.data import prepared_copy as pc
from sft_recipe.data.mixture import mixture_problems, prepare_sources, rows_taken, source_args
from sft_recipe.data.prepare import read_splits
from sft_recipe.data.report import DataReport, measure
from tests.helpers import GUIDE_LORA
from tests.helpers import run_train_in_process as run_train


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "copy_root", lambda: tmp_path / "cache" / pc.PREPARED_DIR)


@pytest.fixture
def questions(tmp_path):
    """A second source, in ShareGPT's layout, whose rows are told apart from the tiny data's: 100 train, 10 test."""
    folder = tmp_path / "questions"
    folder.mkdir()
    for split, count in (("train", 100), ("test", 10)):
        rows = [{"conversations": [{"from": "human", "value": f"{split} question {i}?"},
                                   {"from": "gpt", "value": f"answer {i}."}]} for i in range(count)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _args(tiny, tmp_path, dataset_name, *flags):
    return parse_args(["--model_name_or_path", str(tiny.model_dir), "--dataset_name", dataset_name,
                       "--output_dir", str(tmp_path / "out"), "--max_seq_len", "64", *flags], LaunchEnv())


def _prepare(m, d, t, seed):
    from sft_recipe.train.model import load_tokenizer

    return prepare_sources([read_splits(one) for one in source_args(d)], d, t.dataset_text_field,
                           load_tokenizer(m, False), t.assistant_only_loss, seed=seed)


def _users(dataset) -> list[str]:
    """Each row's conversation, as text (the tiny data's user turns repeat; its conversations do not matter here)."""
    return [json.dumps(row["messages"], sort_keys=True) for row in dataset]


def test_trls_share_rule_takes_as_many_rows_as_it_can_without_repeating_one():
    assert rows_taken([240, 100], None) == [240, 100]  # no shares: every row
    # 0.8/0.2 of 240 and 100 rows: 240 / 0.8 = 300 rows in all (100 / 0.2 = 500 would repeat the first's): 240 + 60
    assert rows_taken([240, 100], [0.8, 0.2]) == [240, 60]
    assert rows_taken([240, 100], [4, 1]) == [240, 60]  # normalised
    # equal shares of 100 and 1,000 rows: the small one caps the mixture at 200
    assert rows_taken([100, 1000], [1, 1]) == [100, 100]


def test_each_source_is_read_as_itself_and_the_seed_picks_and_orders_the_rows(tiny, tmp_path, questions):
    m, d, _, t = _args(tiny, tmp_path, f"{tiny.jsonl_dir},{questions}", "--dataset_proportions", "0.8,0.2")
    first, again, other = (_prepare(m, d, t, seed) for seed in (7, 7, 8))
    train = _users(first.datasets["train"])
    tiny_rows = _users(read_splits(source_args(d)[0]).datasets["train"])
    taken = [u for u in train if "train question" in u]
    assert len(train) == 300 and sorted(u for u in train if u not in taken) == sorted(tiny_rows)  # each once
    assert len(taken) == len(set(taken)) == 60  # 60 distinct questions of the 100
    assert _users(again.datasets["train"]) == train  # the same seed: the same rows in the same order
    other_taken = [u for u in _users(other.datasets["train"]) if "train question" in u]
    assert set(other_taken) != set(taken) and len(other_taken) == 60
    assert train[:240] != tiny_rows  # mixed, not one source after the other (packing fills rows with neighbours)
    assert len(first.datasets["test"]) == 40 + 10  # test splits whole
    assert first.formats["train"] == "messages+sharegpt"
    log = "\n".join(first.notes)
    assert f"data: {questions}: splits train, test: format 'sharegpt' detected" in log
    assert f"mixed 2 sources (--dataset_proportions 0.8,0.2, seed 7): {tiny.jsonl_dir} 240 of 240 train rows, " \
           f"{questions} 60 of 100 train rows" in log


def test_the_report_names_each_source_and_survives_the_prepared_copy(tiny, tmp_path, questions):
    m, d, _, t = _args(tiny, tmp_path, f"{tiny.jsonl_dir},{questions}", "--dataset_proportions", "0.8,0.2",
                       "--seed", "5")
    from sft_recipe.train.model import load_tokenizer

    tokenizer = load_tokenizer(m, False)
    data, from_copy = pc.prepare_here(d, t, tokenizer)
    again, from_copy_again = pc.prepare_here(d, t, tokenizer)
    assert not from_copy and from_copy_again and again.mixture == data.mixture
    report = measure(again, tokenizer, t)
    assert [(s.name, s.format, s.rows_read, s.train_rows, s.train_share, s.test_rows) for s in report.sources] == [
        (str(tiny.jsonl_dir), "messages", 240, 240, 0.8, 40), (str(questions), "sharegpt", 100, 60, 0.2, 10)]
    assert report.splits["train"].rows == 300 and report.splits["train"].rows_read == 340
    assert f"source {questions}: 60 of 100 train rows (20.0% of the mixture, sharegpt, 0 dropped), 10 test rows" \
        in report.render()
    assert DataReport.from_dict(json.loads(report.to_json())) == report
    # another seed takes other rows: another copy
    other = _args(tiny, tmp_path, f"{tiny.jsonl_dir},{questions}", "--dataset_proportions", "0.8,0.2", "--seed", "6")
    assert pc.preparation_key(d, t, tokenizer) != pc.preparation_key(other[1], other[3], tokenizer)
    shares = _args(tiny, tmp_path, f"{tiny.jsonl_dir},{questions}", "--dataset_proportions", "0.5,0.5", "--seed", "5")
    assert pc.preparation_key(d, t, tokenizer) != pc.preparation_key(shares[1], shares[3], tokenizer)


def test_the_eval_slice_is_carved_from_the_mixture(tiny, tmp_path, questions):
    m, d, _, t = _args(tiny, tmp_path, f"{tiny.jsonl_dir},{questions}", "--splits", "train", "--eval_split_size",
                       "34")
    data = _prepare(m, d, t, 3)
    train, test = _users(data.datasets["train"]), _users(data.datasets["test"])
    everything = _users(read_splits(source_args(d)[0]).datasets["train"]) + [
        u for u in train + test if "train question" in u]
    assert (len(train), len(test)) == (340 - 34, 34) and sorted(train + test) == sorted(everything)
    assert any("train question" in u for u in test) and any("train question" not in u for u in test)
    assert data.carved["rows"] == 34 and (data.rows_read["train"], data.rows_read["test"]) == (306, 34)


def _answer_tokens(tokenizer, folder) -> int:
    """Tokens of every train answer and its EOS, counted from the answers alone (the last turn of each row of the
    prompt/completion file): what a prompt/completion source trains."""
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    answers = [row["completion"] if isinstance(row["completion"], str) else row["completion"][-1]["content"]
               for row in rows]
    return sum(len(tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"]) for a in answers)


def _report(tiny, tmp_path, dataset_name, *flags):
    from sft_recipe.train.model import load_tokenizer

    m, d, _, t = _args(tiny, tmp_path, dataset_name, "--dataset_text_field", "content", *flags)
    tokenizer = load_tokenizer(m, False)
    data, from_copy = pc.prepare_here(d, t, tokenizer)
    return data, measure(data, tokenizer, t), from_copy, tokenizer


def test_sources_of_different_shapes_mix_each_with_the_loss_it_trains_alone(tiny, tmp_path, format_datasets):
    # a chat, conversational and plain prompt/completion, and text: four shapes TRL takes one at a time
    names = [str(format_datasets["sharegpt"]), str(format_datasets["prompt_completion_chat"]),
             str(format_datasets["prompt_completion"]), str(tiny.text_dir)]
    alone = [_report(tiny, tmp_path, name)[1].splits["train"] for name in names]
    data, report, _, tokenizer = _report(tiny, tmp_path, ",".join(names))
    train = report.splits["train"]
    assert [s.loss_tokens for s in report.sources] == [one.loss_tokens for one in alone]
    assert train.loss_tokens == sum(one.loss_tokens for one in alone) and train.rows == 4 * 240
    assert train.tokens_trained == sum(one.tokens_trained for one in alone)
    # what each rule means, counted without the recipe: a chat and a text row train every token, prompt/completion
    # rows their answers
    answers = _answer_tokens(tokenizer, format_datasets["prompt_completion"])
    assert [one.loss_token_share for one in (alone[0], alone[3])] == [1.0, 1.0]
    assert report.sources[1].loss_tokens == report.sources[2].loss_tokens == answers
    assert report.splits["test"].rows == 4 * 40
    assert train.format == "sharegpt+prompt_completion+text"
    log = "\n".join(data.notes)
    assert "the sources give TRL different rows" in log and f"{names[3]}: text rows" in log
    assert f"source {names[2]}: 240 of 240 train rows (25.0% of the mixture, prompt_completion, 0 dropped), 40 " \
           f"test rows, {answers} tokens carrying loss" in report.render()


def test_a_mixture_of_shapes_takes_its_shares_and_eval_slice_and_is_kept_as_one_copy(tiny, tmp_path,
                                                                                    format_datasets):
    name = f"{format_datasets['messages']},{format_datasets['alpaca']},{tiny.text_dir}"
    flags = ("--dataset_proportions", "2,1,1", "--splits", "train", "--eval_split_size", "0.1", "--seed", "4")
    data, report, from_copy, _ = _report(tiny, tmp_path, name, *flags)
    again, report_again, from_copy_again, _ = _report(tiny, tmp_path, name, *flags)
    assert not from_copy and from_copy_again and report_again == report
    # 2:1:1 of three sources of 240 rows: all of the first, 120 of each other; 48 of the 480 held out
    assert [s.train_rows for s in report.sources] == [240, 120, 120]
    assert (report.splits["train"].rows, report.splits["test"].rows) == (432, 48)
    assert sum(s.loss_tokens for s in report.sources) == report.splits["train"].loss_tokens
    assert len(again.tokenized["train"]) + len(again.tokenized["test"]) == 480  # every taken row once
    other = _report(tiny, tmp_path, name, *flags[:-1], "5")[1]
    assert other.splits["test"] != report.splits["test"]  # the seed picks the rows


def test_assistant_only_loss_beside_a_source_without_turns_is_refused_naming_both(tiny, tmp_path,
                                                                                 format_datasets):
    m, d, _, t = _args(tiny, tmp_path, f"{format_datasets['sharegpt']},{format_datasets['prompt_completion']}",
                       "--assistant_only_loss", "True")
    with pytest.raises(ConfigError) as e:
        _prepare(m, d, t, 3)
    message = str(e.value)
    assert f"chat sources ({format_datasets['sharegpt']} (sharegpt))" in message
    assert f"but {format_datasets['prompt_completion']} (prompt_completion) has no turns" in message
    assert "Fix: drop --assistant_only_loss" in message


def test_bad_rows_of_every_source_are_listed_together(tiny, tmp_path, questions):
    lines = (questions / "train.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]})
    (questions / "train.jsonl").write_text("\n".join(lines) + "\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.jsonl").write_text('{"messages": []}\n' + (tiny.jsonl_dir / "train.jsonl").read_text())
    (other / "test.jsonl").write_text((tiny.jsonl_dir / "test.jsonl").read_text())
    m, d, _, t = _args(tiny, tmp_path, f"{other},{questions}")
    with pytest.raises(ConfigError) as e:
        _prepare(m, d, t, 3)
    message = str(e.value)
    assert f"{other / 'train.jsonl'} line 1: `messages` is an empty conversation" in message
    assert f"{questions / 'train.jsonl'} line 3: `conversations` message 2 has `value` null" in message


@pytest.mark.parametrize("flags,expected", [
    (["--dataset_proportions", "0.7"], "--dataset_proportions 0.7: 1 share(s) for 2 sources"),
    (["--dataset_proportions", "0.7,0"], "every share must be a positive number"),
    (["--dataset_proportions", "0.7,x"], "give one number per --dataset_name source"),
])
def test_flags_that_do_not_fit_are_refused_before_any_weight(flags, expected, tiny, tmp_path, questions,
                                                             monkeypatch, capsys):
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", f"{tiny.jsonl_dir},{questions}",
            "--output_dir", str(tmp_path / "out"), *GUIDE_LORA, *flags]
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2 and expected in err, err


def test_what_is_said_of_the_sources_without_reading_them(tiny, tmp_path, questions):
    def problems(name, proportions=""):
        return " | ".join(mixture_problems(_args(tiny, tmp_path, name, "--dataset_proportions", proportions)[1]))

    assert problems(f"{tiny.jsonl_dir},{questions}", "3,1") == ""
    assert "names one source" in problems(str(questions), "1")
    assert f"{questions} named twice" in problems(f"{questions},{questions}")
    assert f"--dataset_name {tmp_path / 'nope'}: no such file or folder" in problems(f"{questions},{tmp_path / 'nope'}")


def test_a_recipe_yaml_takes_trls_mixture_list_or_plain_lists(tmp_path):
    known = {"dataset_name", "dataset_proportions", "seed"}
    trl_layout = tmp_path / "trl.yaml"
    trl_layout.write_text("datasets:\n  - path: data/a\n    fraction: 0.7\n  - path: data/b\n    fraction: 0.3\n")
    assert read_recipe_yaml(str(trl_layout), known) == (
        {"dataset_name": "data/a,data/b", "dataset_proportions": "0.7,0.3"}, [])
    lists = tmp_path / "lists.yaml"
    lists.write_text("dataset_name: [data/a, data/b]\ndataset_proportions: [2, 1]\n")
    assert read_recipe_yaml(str(lists), known) == ({"dataset_name": "data/a,data/b", "dataset_proportions": "2,1"},
                                                   [])
    for text, expected in [
        ("datasets:\n  - path: a\n    split: dev\n  - path: b\n", "entry a: split not supported here"),
        ("datasets:\n  - path: a\n    fraction: 0.5\n  - path: b\n", "`fraction` is given for some entries, not all"),
        ("datasets:\n  - path: a\n    weight: 0.5\n", "unexpected keyword argument 'weight'"),
        ("datasets: [a, b]\n", "a list of mappings is expected"),
        ("dataset_name: c\ndatasets:\n  - path: a\n", "both `datasets` and `dataset_name` name the data"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert expected in " | ".join(read_recipe_yaml(str(bad), known)[1]), text


def test_the_mixture_yaml_in_docs_data_md_reads_as_the_flags(tmp_path):
    from tests.helpers import REPO

    page = (REPO / "docs" / "data.md").read_text()
    block = page.split("```yaml\ndatasets:")[1].split("```")[0]
    recipe = tmp_path / "mixture.yaml"
    recipe.write_text("datasets:" + block)
    assert read_recipe_yaml(str(recipe), {"dataset_name", "dataset_proportions"}) == (
        {"dataset_name": "data/chat,data/more_chat", "dataset_proportions": "0.7,0.3"}, [])
