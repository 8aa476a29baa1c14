"""--eval_split_size: a test split held out of the training rows for data that has none (sft_recipe/data/prepare.py
carve_eval_split, datasets' train_test_split): the same rows for the same seed, other rows for another, never one of
them trained on, named in the data report; refused before any weight with a test split beside it, a size that
leaves nothing, or a size that is neither a share nor a count."""

from __future__ import annotations

import json

import pytest

from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.data import prepared_copy as pc
from sft_recipe.data.prepare import prepare, read_splits
from sft_recipe.data.report import measure
from tests.helpers import GUIDE_LORA
from tests.helpers import run_train_in_process as run_train


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "copy_root", lambda: tmp_path / "cache" / pc.PREPARED_DIR)


def _args(tiny, tmp_path, *flags):
    return parse_args(["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
                       "--output_dir", str(tmp_path / "out"), "--splits", "train", "--max_seq_len", "64", *flags],
                      LaunchEnv())


def _tokenizer(m):
    from sft_recipe.train.model import load_tokenizer

    return load_tokenizer(m, False)


def _rows(dataset) -> list[str]:
    return [json.dumps(row["messages"], sort_keys=True) for row in dataset]


def test_the_held_out_rows_are_chosen_by_the_seed_and_never_trained_on(tiny, tmp_path):
    m, d, _, t = _args(tiny, tmp_path, "--eval_split_size", "0.1")
    tokenizer = _tokenizer(m)
    all_rows = _rows(read_splits(d).datasets["train"])
    first = prepare(read_splits(d), d, t.dataset_text_field, tokenizer, seed=7)
    again = prepare(read_splits(d), d, t.dataset_text_field, tokenizer, seed=7)
    other = prepare(read_splits(d), d, t.dataset_text_field, tokenizer, seed=8)
    train, test = _rows(first.datasets["train"]), _rows(first.datasets["test"])
    assert len(test) == 24 and len(train) == 216  # ceil(0.1 x 240)
    assert sorted(train + test) == sorted(all_rows)  # every row once: none trained and evaluated both
    assert _rows(again.datasets["test"]) == test and _rows(other.datasets["test"]) != test
    assert first.carved == {"from": "train", "eval_split_size": 0.1, "seed": 7, "rows": 24}
    assert "24 rows held out of train by --eval_split_size 0.1 (seed 7)" in "\n".join(first.notes)
    assert (first.rows_read["train"], first.rows_read["test"]) == (216, 24)


def test_a_count_holds_out_that_many_and_the_report_names_it(tiny, tmp_path):
    m, d, _, t = _args(tiny, tmp_path, "--eval_split_size", "30", "--seed", "3")
    tokenizer = _tokenizer(m)
    data, _ = pc.prepare_here(d, t, tokenizer)  # through the prepared copy: read back with what was carved
    assert len(data.tokenized["test"]) == 30 and data.carved["rows"] == 30
    report = measure(data, tokenizer, t)
    assert report.splits["test"].held_out_of == "train: --eval_split_size 30, seed 3"
    assert "held out of train: --eval_split_size 30, seed 3" in report.render()
    assert report.splits["train"].rows == 210


@pytest.mark.parametrize("flags,expected", [
    (["--splits", "train,test"], "also reads 'test': one or the other. Fix: --splits train"),
    (["--eval_split_size", "240"], "240 of the 240 training rows would be held out, leaving nothing to train on"),
    (["--eval_split_size", "0"], "--eval_split_size 0: give a share of the training rows between 0 and 1"),
    (["--eval_split_size", "2.5"], "--eval_split_size 2.5: give a share of the training rows between 0 and 1"),
])
def test_refused_before_any_weight(flags, expected, tiny, tmp_path, monkeypatch, capsys):
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), "--output_dir",
            str(tmp_path / "out"), "--splits", "train", "--eval_split_size", "0.1", *GUIDE_LORA, *flags]
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2 and expected in err, err


def test_evaluation_without_a_test_split_names_the_held_out_slice_as_a_fix(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"--eval_split_size 0.05 \(held out of train\)"):
        from sft_recipe.preflight.validate import validate

        m, d, r, t = _args(tiny, tmp_path, "--eval_strategy", "steps", "--eval_steps", "2")
        validate(m, d, r, t, LaunchEnv())
    m, d, r, t = _args(tiny, tmp_path, "--eval_strategy", "steps", "--eval_steps", "2", "--eval_split_size", "0.1")
    from sft_recipe.preflight.validate import validate

    validate(m, d, r, t, LaunchEnv())  # the held-out slice is the test split
