"""The disk is foreseen: what a run writes is estimated before any weight loads, a run whose first save cannot fit is
refused (exit 2), one whose later saves cannot fit is warned with a --save_total_limit that fits; a full disk at a
save ends with exit 74, its message, no traceback, and nothing half-written taken for whole.

Real checkpoints of the tiny model, trained in this process (train.py's own `run`), are what the estimate is
compared with; free space is faked by replacing `shutil.disk_usage`; full disks by an ENOSPC raised from the save
functions the trainer calls (tests/e2e/test_disk_full.py fills real small filesystems).
"""

from __future__ import annotations

import errno
import logging
import shutil
import signal
import sys
from collections import namedtuple

import pytest

from sft_recipe.artifacts.checkpoints import COMPLETE_MARKER, intact_checkpoints, resolve_resume
from sft_recipe.artifacts.disk_full import DISK_FULL_EXIT_CODE, folder_bytes, guarded_save
from sft_recipe.config.args import parse_args
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.errors import DiskFull, is_disk_full
from sft_recipe.preflight.disk_space import disk_space_problems, estimate_writes
from tests.helpers import run_train_in_process

FLAGS = ["--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_alpha", "16",
         "--lora_dropout", "0", "--max_seq_len", "128", "--report_to", "none", "--eval_strategy", "no",
         "--logging_steps", "1", "--seed", "3", "--learning_rate", "3e-3", "--packing", "True",
         "--per_device_train_batch_size", "4", "--bf16", "False", "--save_strategy", "steps", "--save_steps", "1"]
Usage = namedtuple("Usage", "total used free")


def _argv(tiny, out, *extra):
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir),
            "--output_dir", str(out), *FLAGS, *extra]


def _estimate(argv, block_bytes=4096):
    launch = LaunchEnv()
    m, d, _, t = parse_args(argv, launch)
    return estimate_writes(m, d, t, launch, block_bytes), (m, d, t, launch)


def _fake_free(monkeypatch, free_bytes):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * free_bytes, 9 * free_bytes, free_bytes))


def _train(argv, monkeypatch, capsys) -> tuple[int, str]:
    """train.py's entry point in this process, for real (weights, training, saves): (exit code, stderr)."""
    import train

    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    capsys.readouterr()
    code = train.run(LaunchEnv())
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A real run's checkpoints (2 steps, one each) and final adapter."""
    import train

    out = tmp_path_factory.mktemp("disk") / "run"
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    old_argv, sys.argv = sys.argv, ["train.py", *_argv(tiny, out, "--max_steps", "2")]
    try:
        assert train.run(LaunchEnv()) == 0
    finally:
        sys.argv = old_argv
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return out


def test_the_estimate_matches_a_real_checkpoint_and_adapter(tiny, trained, tmp_path):
    import os

    block_bytes = os.statvfs(trained).f_frsize  # as the real files were allocated
    estimate = _estimate(_argv(tiny, tmp_path / "fresh", "--max_steps", "2"), block_bytes)[0]
    first, last = folder_bytes(trained / "checkpoint-1"), folder_bytes(trained / "checkpoint-2")
    assert estimate.checkpoints == 2
    assert abs(estimate.first_checkpoint_bytes - first) <= 0.05 * first, (estimate, first)
    assert abs(estimate.checkpoint_bytes - last) <= 0.05 * last, (estimate, last)
    adapter = sum(folder_bytes(p) for p in trained.iterdir() if p.is_file())  # adapter, tokenizer, records
    assert abs(estimate.adapter_bytes - adapter) <= 0.10 * adapter, (estimate, adapter)
    # Negative control: a LoRA four times larger is estimated larger, so the estimate follows the config.
    bigger = _estimate(_argv(tiny, tmp_path / "fresh", "--max_steps", "2", "--lora_r", "32"), block_bytes)[0]
    assert bigger.checkpoint_bytes > 2 * estimate.checkpoint_bytes


def test_a_resume_counts_the_saves_left_and_the_checkpoints_already_there(tiny, trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    resumed = _estimate([*_argv(tiny, out, "--max_steps", "5", "--save_total_limit", "2"),
                         "--resume_from_checkpoint", "latest"])[0]
    assert (resumed.checkpoints, resumed.existing_checkpoints) == (3, 2)  # steps 3, 4, 5 after checkpoint-2
    # Rotation deletes one old checkpoint per new one, so the run needs room for one more at a time.
    assert resumed.peak_bytes() == max(resumed.checkpoint_bytes, resumed.adapter_bytes)


def test_refuse_warn_or_pass_by_free_space(tiny, tmp_path, monkeypatch, caplog):
    argv = _argv(tiny, tmp_path / "out", "--max_steps", "6")
    estimate, (m, d, t, launch) = _estimate(argv)
    first, peak = estimate.first_checkpoint_bytes, estimate.peak_bytes()
    assert estimate.checkpoints == 6 and peak == 6 * estimate.checkpoint_bytes + estimate.adapter_bytes

    _fake_free(monkeypatch, first - 1)  # the first checkpoint does not fit: refused
    (problem,) = disk_space_problems(m, d, t, launch)
    assert problem.startswith(f"--output_dir {tmp_path / 'out'}: {first - 1:,} bytes are free on its disk")
    assert f"the first checkpoint needs about {first:,}" in problem and "Fix: free space there" in problem

    free = 3 * estimate.checkpoint_bytes + estimate.adapter_bytes // 2  # the first fits, not all six: warned
    _fake_free(monkeypatch, free)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft_recipe.preflight.disk_space"):
        assert disk_space_problems(m, d, t, launch) == []
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    limit = estimate.limit_that_fits(free)
    assert limit == 2 and estimate.peak_bytes(limit) <= free < estimate.peak_bytes(limit + 1)
    assert f"keeps all 6 checkpoints (--save_total_limit unset) of about {estimate.checkpoint_bytes:,}" in warning
    assert f"about {peak:,} at the most" in warning and f"Fix: --save_total_limit {limit} " in warning

    # The suggested limit passes, silently (negative control for the warning).
    m2, d2, _, t2 = parse_args([*argv, "--save_total_limit", str(limit)], launch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft_recipe.preflight.disk_space"):
        assert disk_space_problems(m2, d2, t2, launch) == []
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]

    _fake_free(monkeypatch, peak)  # everything fits: nothing said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft_recipe.preflight.disk_space"):
        assert disk_space_problems(m, d, t, launch) == []
    assert not caplog.records


def test_without_checkpoints_the_final_adapter_must_fit(tiny, tmp_path, monkeypatch):
    argv = [*_argv(tiny, tmp_path / "out", "--max_steps", "6"), "--save_strategy", "no"]
    estimate, (m, d, t, launch) = _estimate(argv)
    assert estimate.checkpoints == 0
    _fake_free(monkeypatch, estimate.adapter_bytes - 1)
    (problem,) = disk_space_problems(m, d, t, launch)
    assert f"the final adapter needs about {estimate.adapter_bytes:,}. Fix:" in problem
    _fake_free(monkeypatch, estimate.adapter_bytes)
    assert disk_space_problems(m, d, t, launch) == []


def test_the_refusal_comes_from_validation_before_any_weight_loads(tiny, tmp_path, monkeypatch, capsys):
    argv = _argv(tiny, tmp_path / "out", "--max_steps", "6")
    estimate, _ = _estimate(argv)
    _fake_free(monkeypatch, estimate.first_checkpoint_bytes - 1)
    code, err = run_train_in_process(argv, monkeypatch, capsys)
    assert code == 2 and "the first checkpoint needs about" in err and "Traceback" not in err
    _fake_free(monkeypatch, estimate.peak_bytes())
    assert run_train_in_process(argv, monkeypatch, capsys)[0] == "weights"  # negative control


def test_what_counts_as_a_full_disk(tmp_path):
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    # safetensors' words for ENOSPC, as a real save onto a full tmpfs raised it (tests/e2e/test_disk_full.py).
    safetensors_error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    python_error = OSError(errno.ENOSPC, "No space left on device", "/mnt/out/trainer_state.json")
    assert is_disk_full(safetensors_error) and is_disk_full(python_error)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    wrapped = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert is_disk_full(wrapped)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("saving failed") from e
    except RuntimeError as chained:
        assert is_disk_full(chained)
    # Negative controls: other write failures are not a full disk.
    assert not is_disk_full(PermissionError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RuntimeError("size mismatch"))
    assert not is_disk_full(CheckpointException("save failed", {0: (PermissionError(errno.EACCES, "no"), None)}))


def test_a_one_process_guarded_save_raises_disk_full_and_removes_its_temp_folder(tmp_path):
    from accelerate import PartialState

    temp = tmp_path / ".writing"
    temp.mkdir()

    def fill():
        (temp / "part").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(temp / "part"))

    with pytest.raises(DiskFull, match=r"the disk filled while writing the final adapter \(No space left on device"):
        guarded_save(PartialState(), tmp_path, fill, cleanup=temp, needed_bytes=1000)
    assert not temp.exists()
    with pytest.raises(ValueError):  # another failure stays what it is
        guarded_save(PartialState(), tmp_path, lambda: (_ for _ in ()).throw(ValueError("not the disk")))
    guarded_save(PartialState(), tmp_path, lambda: None)  # negative control


def test_a_torch_save_failure_counts_as_a_full_disk_only_when_the_disk_is_full(tmp_path, monkeypatch):
    """torch.save reports a full disk without its errno (as measured on a full tmpfs): free space decides."""
    from accelerate import PartialState

    def torch_save_on_a_full_disk():
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") from None

    _fake_free(monkeypatch, 4096)
    with pytest.raises(DiskFull, match="unexpected pos 576 vs 534"):
        guarded_save(PartialState(), tmp_path, torch_save_on_a_full_disk)
    _fake_free(monkeypatch, 100 * 2**30)  # the same error with room to spare is something else
    with pytest.raises(RuntimeError, match="unexpected pos"):
        guarded_save(PartialState(), tmp_path, torch_save_on_a_full_disk)


def test_a_full_disk_at_a_checkpoint_exits_74_and_keeps_the_intact_ones(tiny, tmp_path, monkeypatch, capsys,
                                                                         keep_signal_handlers):
    import sft_recipe.train.trainer as trainer_module

    real = trainer_module.save_optimizer

    def full_at_step_3(optimizer, path):
        if "checkpoint-3" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(optimizer, path)

    monkeypatch.setattr(trainer_module, "save_optimizer", full_at_step_3)
    out = tmp_path / "run"
    code, err = _train(_argv(tiny, out, "--max_steps", "4", "--save_total_limit", "1"), monkeypatch, capsys)
    assert code == DISK_FULL_EXIT_CODE and "Traceback" not in err, err[-3000:]
    assert f"disk full: --output_dir {out}: the disk filled while writing checkpoint-3 (No space left on device: " \
           f"{out / 'checkpoint-3' / 'optimizer.safetensors'})" in err
    assert "Kept: checkpoint-2, the newest intact checkpoint" in err and "--resume_from_checkpoint latest" in err
    assert not (out / "checkpoint-3" / COMPLETE_MARKER).exists()
    # The limit rotated checkpoint-1 away only once checkpoint-2 was complete; the failed save deleted nothing.
    assert [p.name for p in intact_checkpoints(out)] == ["checkpoint-2"]
    assert resolve_resume("latest", str(out)) == (str(out / "checkpoint-2"), [])
    assert not (out / "adapter_model.safetensors").exists()


def test_a_full_disk_at_the_final_adapter_replaces_nothing(tiny, tmp_path, monkeypatch, capsys,
                                                           keep_signal_handlers):
    import sft_recipe.artifacts.adapter as adapter_module

    def full_after_writing(folder, **kwargs):  # the files are written; the disk fills before they are checked
        raise OSError(errno.ENOSPC, "No space left on device", f"{folder}/adapter_model.safetensors")

    out = tmp_path / "run"
    monkeypatch.setattr(adapter_module, "check_adapter", full_after_writing)
    code, err = _train([*_argv(tiny, out, "--max_steps", "2"), "--save_strategy", "no"], monkeypatch, capsys)
    assert code == DISK_FULL_EXIT_CODE and "Traceback" not in err, err[-3000:]
    assert f"disk full: --output_dir {out}: the disk filled while writing the final adapter" in err
    assert "Nothing was replaced" in err and "No intact checkpoint was kept" in err
    assert not (out / "adapter_model.safetensors").exists()
    assert not list(out.glob("_adapter-writing-*"))


def test_a_full_disk_outside_the_saves_still_exits_74_naming_the_file(tiny, tmp_path, monkeypatch, capsys,
                                                                      keep_signal_handlers):
    import sft_recipe.train.record as record_module

    def full(record, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    out = tmp_path / "run"
    monkeypatch.setattr(record_module, "plot_losses", full)
    code, err = _train([*_argv(tiny, out, "--max_steps", "2")], monkeypatch, capsys)
    assert code == DISK_FULL_EXIT_CODE and "Traceback" not in err, err[-3000:]
    assert f"disk full: {out / 'loss_curve.png'}: No space left on device (" in err
    assert "Kept: checkpoint-2, the newest intact checkpoint" in err and "Fix: free space there" in err
    assert (out / "adapter_model.safetensors").is_file()  # saved before: only the loss curve is missing
