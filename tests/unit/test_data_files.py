"""Data files that are damaged, empty, compressed or not UTF-8: each named with what is wrong and the fix, never a
traceback; the intact file reads (the negative control)."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from sft_recipe.config.args import ConfigError, parse_args
from sft_recipe.data.prepare import prepare, read_splits
from tests.helpers import GUIDE_LORA
from tests.helpers import run_train_in_process as run_train


def _read(folder, *extra):
    data_args = parse_args(["--dataset_name", str(folder), *extra])[1]
    return read_splits(data_args)


def _prepared(folder, tokenizer, *extra):
    _, data_args, _, training_args = parse_args(["--dataset_name", str(folder), *extra])
    return prepare(read_splits(data_args), data_args, training_args.dataset_text_field, tokenizer)


def _problems(call) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    return "\n".join(e.value.problems)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny.model_dir))


@pytest.fixture()
def jsonl(tiny, tmp_path):
    folder = tmp_path / "jsonl"
    shutil.copytree(tiny.jsonl_dir, folder)
    return folder


def _append_latin1_line(path):
    with open(path, "ab") as f:
        f.write('{"messages": [{"role": "user", "content": "café"}, {"role": "assistant", "content": "oui"}]}\n'
                .encode("latin-1"))


def test_a_jsonl_line_that_is_not_utf8_is_a_bad_row_named_by_file_and_line(jsonl, tokenizer):
    assert len(_prepared(jsonl, tokenizer).datasets["train"]) == 240  # intact
    _append_latin1_line(jsonl / "train.jsonl")
    message = _problems(lambda: _prepared(jsonl, tokenizer))
    assert f"{jsonl / 'train.jsonl'} line 241: not UTF-8 text (byte 0xe9 at column 47)" in message
    assert "--drop_bad_rows True" in message
    assert len(_prepared(jsonl, tokenizer, "--drop_bad_rows", "True").datasets["train"]) == 240


def test_not_utf8_through_train_py_is_exit_2_without_a_traceback(tiny, jsonl, tmp_path, monkeypatch, capsys):
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(jsonl), "--output_dir",
            str(tmp_path / "out"), *GUIDE_LORA]
    assert run_train(argv, monkeypatch, capsys)[0] == "weights"  # intact: reaches the weights
    _append_latin1_line(jsonl / "train.jsonl")
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2 and "line 241: not UTF-8 text" in err and "Traceback" not in err, err


def test_gzip_jsonl_is_read_under_either_name_and_bad_lines_keep_their_numbers(jsonl, tokenizer):
    rows = (jsonl / "train.jsonl").read_bytes()
    for name in ("train.jsonl.gz", "train.jsonl"):  # gzip data named .gz, and gzip data under a plain .jsonl name
        (jsonl / "train.jsonl").unlink(missing_ok=True)
        (jsonl / "train.jsonl.gz").unlink(missing_ok=True)
        (jsonl / name).write_bytes(gzip.compress(rows))
        assert len(_prepared(jsonl, tokenizer).datasets["train"]) == 240, name
        (jsonl / name).write_bytes(gzip.compress(rows + b'{"messages": []}\n'))  # rewritten: read anew
        message = _problems(lambda: _prepared(jsonl, tokenizer))
        assert f"{jsonl / name} line 241: `messages` is an empty conversation" in message, name
    single = jsonl.parent / "single.jsonl.gz"  # --dataset_name naming one compressed file
    single.write_bytes(gzip.compress(rows))
    assert len(_read(single, "--splits", "train").datasets["train"]) == 240


def test_a_damaged_gzip_file_is_named(jsonl):
    (jsonl / "train.jsonl").unlink()
    data = gzip.compress((jsonl / "test.jsonl").read_bytes())
    (jsonl / "train.jsonl.gz").write_bytes(data[: len(data) // 2])
    message = _problems(lambda: _read(jsonl))
    assert "train.jsonl.gz: a damaged or truncated gzip file" in message and "Fix:" in message


@pytest.mark.parametrize("content", [b"", b"\n\n"], ids=["zero bytes", "blank lines"])
def test_an_empty_split_says_it_has_no_rows(jsonl, tokenizer, content):
    (jsonl / "train.jsonl").write_bytes(content)
    message = _problems(lambda: _prepared(jsonl, tokenizer))
    assert "has no rows" in message and "Columns: []" not in message and str(jsonl / "train.jsonl") in message
    assert "Fix:" in message


def test_an_empty_test_split_names_the_eval_fix(jsonl, tokenizer):
    (jsonl / "test.jsonl").write_text("\n")
    message = _problems(lambda: _prepared(jsonl, tokenizer))
    assert "split 'test' has no rows" in message and "--eval_strategy no" in message


@pytest.fixture()
def parquet(tiny, tmp_path):
    folder = tmp_path / "parquet"
    shutil.copytree(tiny.parquet_dir, folder)
    return folder


@pytest.mark.parametrize("damage,expected", [
    (lambda p: p.write_bytes(p.read_bytes()[:2000]), "a Parquet file cut short (no 'PAR1' marker at its end"),
    (lambda p: p.write_bytes(b""), "the file is empty (0 bytes), so split 'train' has no rows"),
    (lambda p: p.write_bytes(gzip.compress(p.read_bytes())), "gzip data, not Parquet"),
    (lambda p: p.write_text("a,b\n1,2\n"), "not Parquet (no 'PAR1' marker at its start)"),
], ids=["truncated", "empty", "gzip", "csv named parquet"])
def test_a_parquet_file_that_cannot_be_read_is_named(parquet, damage, expected):
    assert len(_read(parquet).datasets["train"]) == 240  # intact
    damage(parquet / "train.parquet")
    message = _problems(lambda: _read(parquet))
    assert f"{parquet / 'train.parquet'}: {expected}" in message and "Fix:" in message, message


@pytest.fixture()
def csv(tiny, tmp_path):
    folder = tmp_path / "csv"
    shutil.copytree(tiny.text_dir, folder)
    return folder


def test_csv_files_that_cannot_be_read_are_named(csv):
    train = csv / "train.csv"
    text = train.read_bytes()
    assert len(_read(csv).datasets["train"]) == 240  # intact
    train.write_bytes(text.replace(b"Answer", "Ànswer".encode("latin-1"), 1))
    assert f"{train} line 3: not UTF-8 text (byte 0xc0 at column 1)" in _problems(lambda: _read(csv))
    train.write_bytes(gzip.compress(text))
    assert "gzip data under a .csv name" in _problems(lambda: _read(csv))
    train.unlink()
    (csv / "train.csv.gz").write_bytes(gzip.compress(text))  # a compressed CSV named so is read
    assert len(_read(csv).datasets["train"]) == 240
    (csv / "train.csv.gz").unlink()
    train.write_text('content\n"an unterminated quote\n')
    message = _problems(lambda: _read(csv))
    assert f"{train}: could not be read as CSV (" in message and "Fix:" in message, message


def test_a_json_document_that_is_not_utf8_names_its_line(jsonl, tmp_path):
    rows = [json.loads(line) for line in (jsonl / "train.jsonl").read_text().splitlines()]
    document = tmp_path / "rows.json"
    document.write_text(json.dumps(rows, indent=1))
    assert len(_read(document, "--splits", "train").datasets["train"]) == 240  # intact
    document.write_bytes(document.read_bytes().replace(b"Answer", b"\xc0nswer", 1))
    message = _problems(lambda: _read(document, "--splits", "train"))
    assert f"{document} line " in message and "not UTF-8 text (byte 0xc0" in message
    assert "Fix: save the file as UTF-8" in message
