"""Exit 2 changes nothing in output_dir (docs/reliability.md): every refusal that comes before the weights (a bad
data row here) comes before --overwrite_output_dir moves the previous run aside, before damaged checkpoints move
aside, and before anything is written; a refused launch into a folder that did not exist leaves none behind. A
--preview_examples run (exit 0, nothing trained) moves nothing either."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from tests.helpers import GUIDE_LORA
from tests.helpers import run_train_in_process as run_train


def _snapshot(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture()
def previous_run(tmp_path):
    """An output_dir holding a finished run: a checkpoint, its adapter, a preemption note, and a damaged
    checkpoint-3 (no completion marker) that a resume or an overwrite would move aside."""
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"previous weights")
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "optimizer.safetensors").write_bytes(b"half written")
    (out / "adapter_model.safetensors").write_bytes(b"previous adapter")
    (out / "preempted.json").write_text('{"signal": "SIGTERM", "global_step": 2, "checkpoint": "checkpoint-2"}')
    return out


def _bad_data(tiny, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny.jsonl_dir, data)
    with open(data / "train.jsonl", "a") as f:
        f.write('{"messages": "not a list of turns"}\n')
    return data


def test_a_refused_overwrite_leaves_the_previous_run_where_it_was(tiny, tmp_path, previous_run, monkeypatch, capsys):
    before = _snapshot(previous_run)
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(_bad_data(tiny, tmp_path)),
            "--output_dir", str(previous_run), "--overwrite_output_dir", "True", *GUIDE_LORA]
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2 and "line 241" in err, err
    assert _snapshot(previous_run) == before  # before: _previous-run-<time>/ held the checkpoints and the note


def test_a_refused_launch_into_a_new_folder_leaves_no_folder(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "out"
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(_bad_data(tiny, tmp_path)),
            "--output_dir", str(out), *GUIDE_LORA]
    code, err = run_train(argv, monkeypatch, capsys)
    assert code == 2, err
    assert not out.exists()


def test_a_preview_with_overwrite_moves_nothing(tiny, tmp_path, previous_run, monkeypatch, capsys):
    before = _snapshot(previous_run)
    argv = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(previous_run), "--overwrite_output_dir", "True", "--preview_examples", "1",
            *GUIDE_LORA]
    with pytest.raises(SystemExit) as done:  # the preview prints and exits before any weight
        run_train(argv, monkeypatch, capsys)
    assert done.value.code in (0, None)
    assert _snapshot(previous_run) == before
