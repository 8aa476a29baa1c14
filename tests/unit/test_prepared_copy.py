"""The data is tokenized once, by TRL's own preparation, kept in datasets' cache, and read back by a later
launch when nothing that decides it changed (sft_recipe/data/prepared_copy.py); the trainer given those rows does
exactly what it would do with the raw rows, without tokenizing them again. Multi-process ordering runs in the real
launches of tests/e2e/test_train.py, test_multinode.py and tests/test_deepspeed.py (their run records' `data`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sft_recipe.config.args import parse_args
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.data import prepared_copy as pc
from sft_recipe.data import report as data_report
from sft_recipe.data.prepare import prepare


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Copies in this test's own datasets cache."""
    monkeypatch.setattr(pc, "copy_root", lambda: tmp_path / "cache" / pc.PREPARED_DIR)
    return tmp_path / "cache" / pc.PREPARED_DIR


def _args(tiny, out, *flags):
    return parse_args(["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
                       "--output_dir", str(out), "--chat_template_format", "chatml", "--max_seq_len", "64",
                       "--report_to", "none", *flags], LaunchEnv())


def _tokenizer(model_args):
    from sft_recipe.train.model import load_tokenizer

    return load_tokenizer(model_args, False)


def _trainer(tiny, tokenizer, train, training_args):
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    model.resize_token_embeddings(len(tokenizer))
    return SFTTrainer(model=model, args=training_args, train_dataset=train, processing_class=tokenizer)


def test_trl_preparation_still_orders_ranks(tiny, tmp_path, monkeypatch):
    # TRL's _prepare_dataset waits for every rank (main_process_first): one rank alone would hang there. The recipe's
    # own call runs without it; TRL's, as it ships, still enters it (when it stops, without_rank_barriers can go).
    from accelerate import PartialState
    from trl import SFTTrainer

    m, d, _, t = _args(tiny, tmp_path / "out")
    tokenizer = _tokenizer(m)
    rows = prepare(pc.read_splits(d), d, t.dataset_text_field, tokenizer).datasets["train"]

    def barrier(self):
        raise AssertionError("waited for every rank")

    monkeypatch.setattr(PartialState, "wait_for_everyone", barrier)
    assert len(data_report.tokenize_like_trl(rows, tokenizer, t)) == len(rows)
    fake = type("T", (), {"_tokenizer": tokenizer, "completion_only_loss": False, "chat_template": None})()
    with pytest.raises(AssertionError, match="waited for every rank"):
        SFTTrainer._prepare_dataset(fake, rows, tokenizer, t, False, None, "train")


@pytest.mark.parametrize("flags", [("--packing", "True"), ("--packing", "False"),
                                   ("--packing", "False", "--truncation_mode", "keep_end"),
                                   ("--packing", "True", "--assistant_only_loss", "True")],
                         ids=["packing", "truncation", "keep_end", "assistant_only_loss"])
def test_the_trainer_cuts_or_packs_the_tokenized_rows_as_it_would_the_raw_rows_without_tokenizing(
        tiny, tmp_path, monkeypatch, flags):
    import trl.trainer.sft_trainer as sft

    m, d, _, t = _args(tiny, tmp_path / "out", "--max_seq_len", "24", *flags)  # some examples are cut
    tokenizer = _tokenizer(m)
    data = prepare(pc.read_splits(d), d, t.dataset_text_field, tokenizer,
                      assistant_only_loss=t.assistant_only_loss)
    from_rows = _trainer(tiny, tokenizer, data.datasets["train"], t).train_dataset
    data, _ = pc.prepare_here(d, t, tokenizer)  # as train.py gets it: the copy, read back
    calls = []
    real = sft._tokenize
    monkeypatch.setattr(sft, "_tokenize", lambda *a, **k: calls.append(1) or real(*a, **k))
    from_tokenized = _trainer(tiny, tokenizer, data.tokenized["train"], t).train_dataset
    assert calls == []  # the trainer tokenized nothing: it only cut or packed
    assert from_tokenized.column_names == from_rows.column_names
    for column in from_rows.column_names:
        assert from_tokenized[column] == from_rows[column], column
    report = data_report.measure(data, tokenizer, t)  # the report's prediction is what the trainer then holds
    data_report.confirm(report, from_tokenized, str(tmp_path / "out"), True)
    assert report.trainer_check["matches_prediction"], report.trainer_check


def test_a_second_launch_reads_the_copy_and_a_change_that_decides_it_prepares_it_again(tiny, tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(tiny.jsonl_dir, data_dir)
    out = tmp_path / "out"

    def launch(*flags, chat="chatml", output_dir=out):
        m, d, _, t = parse_args(["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(data_dir),
                                 "--output_dir", str(output_dir), "--chat_template_format", chat, "--report_to", "none",
                                 *flags], LaunchEnv())
        data, reused = pc.prepare_here(d, t, _tokenizer(m))
        return data, reused, t

    first, reused, t = launch()
    assert not reused and (Path(first.copy_dir) / pc.META_FILE).is_file()
    again, reused, _ = launch("--max_seq_len", "32", "--packing", "True")  # cut and packing: not in the key
    assert reused and again.formats == first.formats and again.rows_read == first.rows_read
    assert again.tokenized["train"]["input_ids"] == first.tokenized["train"]["input_ids"]
    assert launch(output_dir=tmp_path / "another-run")[1]  # a sweep's next run, into its own output_dir
    assert launch(chat="zephyr")[1] is False  # another chat template: another tokenization
    assert launch(chat="zephyr")[1] is True
    assert launch("--dataset_role_map", "human=user", chat="zephyr")[1] is False  # a format flag
    with open(data_dir / "train.jsonl", "a") as f:  # the data changed
        f.write(json.dumps({"messages": [{"role": "user", "content": "One more?"},
                                         {"role": "assistant", "content": "Yes."}]}) + "\n")
    changed, reused, _ = launch("--dataset_role_map", "human=user", chat="zephyr")
    assert not reused and changed.rows_read["train"] == first.rows_read["train"] + 1
    assert not [p for p in pc.copy_root().iterdir() if p.name.startswith(".")]  # nothing half-written left


@pytest.mark.parametrize("damage", ["meta", "split", "foreign"])
def test_a_damaged_or_foreign_copy_is_prepared_again(tiny, tmp_path, damage):
    m, d, _, t = _args(tiny, tmp_path / "out")
    tokenizer = _tokenizer(m)
    folder = Path(pc.prepare_here(d, t, tokenizer)[0].copy_dir)
    if damage == "meta":
        (folder / pc.META_FILE).write_text("{not json")
    elif damage == "split":
        shutil.rmtree(folder / "train")
    else:
        meta = json.loads((folder / pc.META_FILE).read_text())
        (folder / pc.META_FILE).write_text(json.dumps({**meta, "key": "another-run"}))
    data, reused = pc.prepare_here(d, t, tokenizer)
    assert not reused and len(data.tokenized["train"]) == data.rows_read["train"]
    assert pc.prepare_here(d, t, tokenizer)[1]  # and the new copy is whole


def test_a_copy_that_cannot_be_written_leaves_the_run_going_and_nothing_half_written(tiny, tmp_path, monkeypatch,
                                                                                      caplog):
    import errno

    m, d, _, t = _args(tiny, tmp_path / "out")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pc.os, "link", full)  # the copy's links, and the copy made where links fail
    monkeypatch.setattr(pc.shutil, "copyfile", full)
    data, reused = pc.prepare_here(d, t, _tokenizer(m))
    assert not reused and len(data.tokenized["train"]) == data.rows_read["train"]
    assert "could not keep the prepared data" in caplog.text and "No space left" in caplog.text
    assert not pc.copy_root().exists() or not list(pc.copy_root().iterdir())


def test_the_report_is_the_same_read_a_few_rows_at_a_time(tiny, tmp_path, monkeypatch):
    m, d, _, t = _args(tiny, tmp_path / "out", "--packing", "False", "--max_seq_len", "24")
    tokenizer = _tokenizer(m)
    data = pc.tokenize(prepare(pc.read_splits(d), d, t.dataset_text_field, tokenizer), tokenizer, t)
    assert data.tokenized["train"].cache_files  # read from its Arrow files as a stream, batch by batch
    whole = data_report.measure(data, tokenizer, t)
    from datasets import Dataset

    data.tokenized = {role: Dataset.from_dict(ds.to_dict()) for role, ds in data.tokenized.items()}  # in memory
    assert not data.tokenized["train"].cache_files
    monkeypatch.setattr(data_report, "BATCH_ROWS", 7)  # 240 rows: 35 batches, the last one short
    assert data_report.measure(data, tokenizer, t) == whole
    assert whole.splits["train"].examples_cut_share > 0  # the cut is measured, not trivially zero


def test_tokenizing_processes_come_from_the_cpus_with_enough_rows_each():
    cpus = len(os.sched_getaffinity(0))
    assert pc.tokenizing_processes(100, None) == 1  # a worker would cost more than it saves
    assert pc.tokenizing_processes(10 * pc.MIN_ROWS_PER_PROCESS, None) == min(cpus, 10)
    assert pc.tokenizing_processes(10 * pc.MIN_ROWS_PER_PROCESS, 3) == 3  # --dataset_num_proc decides
    assert pc.describe({"prepared_on_ranks": [0], "read_copy_on_ranks": [1, 2], "seconds_per_rank": [3.0, 0, 0]},
                       "cache/x") == "data: prepared by rank 0 in 3.0 s, kept in cache/x; rank 1, 2 read it"


def test_ranks_preparing_at_once_share_the_machines_cpus(monkeypatch):
    """When no copy could be kept, the 7 ranks after a machine's first prepare together: 16 CPUs give each 2
    processes (16 // 7), not 16 each (112 tokenizing processes on 16 CPUs)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    rows = 100 * pc.MIN_ROWS_PER_PROCESS
    assert pc.tokenizing_processes(rows, None) == 16
    assert pc.tokenizing_processes(rows, None, sharing=7) == 2
    assert pc.tokenizing_processes(rows, None, sharing=32) == 1  # never none
    assert pc.tokenizing_processes(rows, 6, sharing=7) == 6  # --dataset_num_proc is the user's choice


def test_a_launch_with_the_same_cut_reads_its_report_beside_the_copy_and_another_cut_measures_again(
        tiny, tmp_path, monkeypatch):
    def launch(*flags):
        m, d, _, t = _args(tiny, tmp_path / "out", *flags)
        tokenizer = _tokenizer(m)
        data, _ = pc.prepare_here(d, t, tokenizer)
        return pc.measure_report(data, tokenizer, t)

    first = launch("--max_seq_len", "24", "--packing", "False")
    real = data_report._example_stats
    monkeypatch.setattr(data_report, "_example_stats", lambda *a: pytest.fail("read every token again"))
    assert launch("--max_seq_len", "24", "--packing", "False") == first  # a resume: no token read
    monkeypatch.setattr(data_report, "_example_stats", real)
    other = launch("--max_seq_len", "48", "--packing", "False")
    assert other.max_length == 48
    assert other.splits["train"].examples_cut_share < first.splits["train"].examples_cut_share
    (folder,) = pc.copy_root().iterdir()
    assert len(json.loads((folder / pc.META_FILE).read_text())["reports"]) == 2


def test_the_trainers_own_counts_are_read_once_per_copy_and_cut(tiny, tmp_path, monkeypatch):
    def launch():
        m, d, _, t = _args(tiny, tmp_path / "out", "--max_seq_len", "32", "--packing", "True")
        tokenizer = _tokenizer(m)
        data, _ = pc.prepare_here(d, t, tokenizer)
        report = pc.measure_report(data, tokenizer, t)
        trainer = _trainer(tiny, tokenizer, data.tokenized["train"], t)
        pc.confirm_report(report, data, trainer.train_dataset, t, True)
        return report

    first = launch()
    assert first.trainer_check["matches_prediction"], first.trainer_check
    monkeypatch.setattr(data_report, "confirm", lambda *a: pytest.fail("read the trainer's rows again"))
    assert launch().trainer_check == first.trainer_check


@pytest.mark.parametrize("processes", [None, 2])
def test_the_copy_links_the_files_tokenizing_wrote_and_reads_back_the_same_rows(tiny, tmp_path, processes):
    shutil.copytree(tiny.jsonl_dir, tmp_path / "data")  # data of its own: no map cache of an earlier test
    m, d, _, t = parse_args(["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tmp_path / "data"),
                             "--output_dir", str(tmp_path / "out"), "--chat_template_format", "chatml"], LaunchEnv())
    tokenizer = _tokenizer(m)
    data = prepare(pc.read_splits(d), d, t.dataset_text_field, tokenizer)
    data.tokenized = {role: data_report.tokenize_like_trl(ds, tokenizer, t, num_proc=processes, name=role)
                      for role, ds in data.datasets.items()}
    written = [f["filename"] for f in data.tokenized["train"].cache_files]
    assert len(written) == (processes or 1)  # one Arrow file per tokenizing process
    assert pc.save_copy(data, "k")
    copy = pc.load_copy("k")
    linked = sorted((pc.copy_root() / "k" / "train").glob("part-*.arrow"))
    assert [os.stat(p).st_ino for p in linked] == [os.stat(p).st_ino for p in written]  # links: no byte copied
    for role, fresh in data.tokenized.items():
        assert copy.tokenized[role].column_names == fresh.column_names  # the rows' own columns too
        for column in fresh.column_names:
            assert copy.tokenized[role][column] == fresh[column], (role, column)


def test_two_launches_saving_the_same_copy_keep_one_and_ctrl_c_while_saving_leaves_nothing(tiny, tmp_path,
                                                                                            monkeypatch):
    m, d, _, t = _args(tiny, tmp_path / "out")
    tokenizer = _tokenizer(m)
    data = pc.tokenize(prepare(pc.read_splits(d), d, t.dataset_text_field, tokenizer), tokenizer, t)
    assert pc.save_copy(data, "k")
    first = (pc.copy_root() / "k" / pc.META_FILE).stat().st_ino
    assert pc.save_copy(data, "k")  # a second launch finishing later: the first copy stays, no warning, no leftover
    assert (pc.copy_root() / "k" / pc.META_FILE).stat().st_ino == first
    assert sorted(p.name for p in pc.copy_root().iterdir()) == ["k"]

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pc, "_write_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pc.save_copy(data, "other")
    assert sorted(p.name for p in pc.copy_root().iterdir()) == ["k"]


def _dataset_generation_error():
    from datasets.exceptions import DatasetGenerationError

    try:
        try:
            raise OSError(28, "No space left on device")  # what pyarrow raises writing an arrow file
        except OSError as e:
            raise DatasetGenerationError("An error occurred while generating the dataset") from e
    except DatasetGenerationError as wrapped:
        return wrapped


@pytest.mark.parametrize("failure", ["full", "wrapped", "read-only"])
def test_an_unwritable_datasets_cache_prepares_in_a_temporary_one_with_one_warning(failure, tiny, tmp_path,
                                                                                    monkeypatch, caplog):
    """A home quota or a read-only cache: datasets fails writing its cache (load_dataset, its maps). The launch goes
    on in a temporary cache, with one warning naming the cache folder and HF_DATASETS_CACHE (it used to exit 74,
    naming the project folder's free space)."""
    import errno
    import logging

    import datasets

    full = tmp_path / "quota-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", full)
    monkeypatch.setattr(pc, "copy_root", lambda: Path(datasets.config.HF_DATASETS_CACHE) / pc.PREPARED_DIR)
    errors = {"full": OSError(errno.ENOSPC, "No space left on device"), "wrapped": _dataset_generation_error(),
              "read-only": OSError(errno.EROFS, "Read-only file system")}
    real = pc.read_splits

    def read_splits(*args, **kwargs):
        if Path(datasets.config.HF_DATASETS_CACHE) == full:
            raise errors[failure]
        return real(*args, **kwargs)

    monkeypatch.setattr(pc, "read_splits", read_splits)
    m, d, _, t = _args(tiny, tmp_path / "out")
    with caplog.at_level(logging.WARNING):
        data, reused = pc.prepare_here(d, t, _tokenizer(m))
    assert len(data.tokenized["train"]) == 240 and not reused
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"datasets could not write its cache in {full}" in warnings[0], warnings
    assert "HF_DATASETS_CACHE" in warnings[0] and "keeps no copy" in warnings[0]
    assert "sft-recipe-datasets-" in str(datasets.config.HF_DATASETS_CACHE)


def test_another_failure_while_preparing_is_raised_as_it_was(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "read_splits", lambda *a, **k: (_ for _ in ()).throw(ValueError("not a cache problem")))
    m, d, _, t = _args(tiny, tmp_path / "out")
    with pytest.raises(ValueError, match="not a cache problem"):
        pc.prepare_here(d, t, _tokenizer(m))
