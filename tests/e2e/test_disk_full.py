"""A full disk at a checkpoint: real runs of the tiny model whose output_dir is a small tmpfs (`mount -t tmpfs`, as
root; CI runs as root), sized from the launch-time estimate so that two checkpoints fit and the third does not.

- One process: warned at launch with a --save_total_limit that fits; exits 74 at checkpoint-3 with the message (the
  folder, bytes needed and free, the newest intact checkpoint), no traceback; checkpoint-3 is left unmarked and
  `latest` resolves to checkpoint-2; the estimate is within 5% of the real checkpoints; copied to a bigger disk, the
  run resumes from checkpoint-2 and finishes.
- FSDP2 on 2 ranks: torch's distributed checkpoint raises on both ranks; both exit 74 within a bounded time.
- FSDP2 on 2 ranks where only rank 1's write fails (its RNG state, tests/e2e/disk_full_worker.py): both ranks still
  end, exit 74, and the message names rank 1.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from sft_recipe.artifacts.checkpoints import COMPLETE_MARKER, checkpoint_damage, intact_checkpoints, resolve_resume
from sft_recipe.artifacts.disk_full import folder_bytes
from sft_recipe.config.args import parse_args
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.preflight.disk_space import estimate_writes
from tests.helpers import launch_env, launch_script, launch_train, run_command

FLAGS = ["--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_alpha", "16",
         "--lora_dropout", "0", "--max_seq_len", "128", "--report_to", "none", "--eval_strategy", "no",
         "--logging_steps", "1", "--seed", "3", "--learning_rate", "3e-3", "--packing", "True",
         "--per_device_train_batch_size", "4", "--bf16", "False", "--save_strategy", "steps", "--save_steps", "1",
         "--max_steps", "4"]
FSDP2 = "cpu/fsdp2_config.yaml"
FSDP2_LAUNCH = LaunchEnv(world_size=2, use_cpu=True, use_fsdp=True, fsdp_version=2,
                         fsdp_state_dict_type="SHARDED_STATE_DICT")
PAGE_BYTES = 4096
RANK_TRACEBACK = re.compile(r"^\[rank\d+\]:", re.MULTILINE)  # how torchrun prefixes a rank's traceback lines


def _common(tiny):
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *FLAGS]


def _checkpoint_bytes(tiny, out, launch: LaunchEnv) -> int:
    m, d, _, t = parse_args([*_common(tiny), "--output_dir", str(out)], launch)
    return estimate_writes(m, d, t, launch, PAGE_BYTES).checkpoint_bytes


@contextmanager
def small_filesystem(path, size_bytes: int):
    """A tmpfs of `size_bytes` at `path`, unmounted afterwards; skips where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    size = math.ceil(size_bytes / PAGE_BYTES) * PAGE_BYTES
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _size_for_two(checkpoint_bytes: int) -> int:
    """Two checkpoints and half of a third, beside data_report.json and the model card (a page each)."""
    return 2 * PAGE_BYTES + 2 * checkpoint_bytes + checkpoint_bytes // 2


def test_one_process_exits_74_keeps_the_intact_checkpoints_and_resumes_elsewhere(tiny, tmp_path):
    disk = tmp_path / "small"
    out = disk / "run"
    checkpoint_bytes = _checkpoint_bytes(tiny, out, LaunchEnv(use_cpu=True))
    with small_filesystem(disk, _size_for_two(checkpoint_bytes)):
        started = time.time()
        result = run_command([sys.executable, "train.py", "--output_dir", str(out), *_common(tiny)], out)  # own code
        elapsed_s = time.time() - started
        output = result.output
        assert result.returncode == 74, output[-4000:]
        assert "Traceback" not in output and "SafetensorError" not in output, output[-4000:]
        assert re.search(rf"WARNING .*--output_dir {re.escape(str(out))}: [\d,]+ bytes are free on its disk .*"
                         r"Fix: --save_total_limit 1 ", output), output[:6000]
        assert f"disk full: --output_dir {out}: the disk filled while writing checkpoint-3 (" in output
        assert re.search(r"a checkpoint takes [\d,]+ bytes on disk \(checkpoint-2\), and [\d,]+ were free when the "
                         r"save started", output)
        assert "checkpoint-3 is incomplete (no checkpoint_complete.json" in output
        assert "Kept: checkpoint-2, the newest intact checkpoint (intact: checkpoint-2, checkpoint-1)" in output
        assert not (out / "checkpoint-3" / COMPLETE_MARKER).exists()
        assert [p.name for p in intact_checkpoints(out)] == ["checkpoint-2", "checkpoint-1"]
        assert resolve_resume("latest", str(out)) == (str(out / "checkpoint-2"), [])
        assert not (out / "adapter_model.safetensors").exists()
        for step in (1, 2):  # the estimate against the real checkpoints (tmpfs: folders take no block)
            real = folder_bytes(out / f"checkpoint-{step}")
            assert abs(checkpoint_bytes - real) <= 0.05 * real, (step, checkpoint_bytes, real)
        bigger = tmp_path / "bigger" / "run"
        shutil.copytree(out, bigger)
    print(f"one process: {elapsed_s:.1f} s, estimate {checkpoint_bytes:,} bytes per checkpoint, real "
          f"{folder_bytes(bigger / 'checkpoint-2'):,} (copied)")

    resumed = launch_train("cpu/single.yaml", bigger, [*_common(tiny), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.record["training"]["global_steps"] == 4
    assert checkpoint_damage(bigger / "checkpoint-3") == [] and (bigger / "adapter_model.safetensors").is_file()


def _assert_both_ranks_exit_74(result, elapsed_s: float) -> None:
    output = result.output
    assert result.returncode != 0 and output.count("exitcode  : 74") == 2, output[-4000:]  # both ranks' own code
    assert not RANK_TRACEBACK.search(output), output[-4000:]  # the only traceback is the launcher's summary
    assert elapsed_s < 240, elapsed_s


def test_fsdp2_both_ranks_exit_74_when_the_shared_disk_fills(tiny, tmp_path):
    disk = tmp_path / "small"
    out = disk / "run"
    checkpoint_bytes = _checkpoint_bytes(tiny, out, FSDP2_LAUNCH)
    with small_filesystem(disk, _size_for_two(checkpoint_bytes)):
        started = time.time()
        result = launch_train(FSDP2, out, _common(tiny))
        _assert_both_ranks_exit_74(result, time.time() - started)
        assert f"disk full: --output_dir {out}: the disk filled while writing checkpoint-3 (" in result.output
        assert "Kept: checkpoint-2, the newest intact checkpoint" in result.output
        assert resolve_resume("latest", str(out)) == (str(out / "checkpoint-2"), [])
        for step in (1, 2):
            real = folder_bytes(out / f"checkpoint-{step}")
            assert abs(checkpoint_bytes - real) <= 0.05 * real, (step, checkpoint_bytes, real)
        print(f"fsdp2: estimate {checkpoint_bytes:,} bytes per checkpoint, real "
              f"{folder_bytes(out / 'checkpoint-2'):,}")


def test_fsdp2_ranks_end_together_when_only_one_ranks_write_fails(tiny, tmp_path):
    out = tmp_path / "run"
    started = time.time()
    result = launch_script(FSDP2, "tests/e2e/disk_full_worker.py", ["--output_dir", str(out), *_common(tiny)], out)
    _assert_both_ranks_exit_74(result, time.time() - started)
    assert f"disk full: --output_dir {out}: the disk filled while writing checkpoint-2 on rank 1 (" in \
        result.output, result.output[-4000:]
    assert not (out / "checkpoint-2" / COMPLETE_MARKER).exists()
    assert resolve_resume("latest", str(out)) == (str(out / "checkpoint-1"), [])
    assert os.path.isfile(out / "checkpoint-2" / "rng_state_0.safetensors")  # rank 0's part was written


def test_a_full_datasets_cache_trains_on_without_the_copy(tiny, tmp_path):
    """HF_DATASETS_CACHE on a 1 MiB filesystem (a cluster home quota) and 4,000 rows, two FSDP2 ranks: datasets
    cannot write its cache. The run trains on in a temporary cache with one warning naming that folder and
    HF_DATASETS_CACHE (it used to exit 74 naming the project folder's free space), and rank 1 reads what rank 0
    prepared there (it used to prepare the data again, at the same time as any other rank of the machine)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = (tiny.jsonl_dir / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(rows * (4000 // len(rows) + 1)) + "\n")
    shutil.copy(tiny.jsonl_dir / "test.jsonl", data / "test.jsonl")
    with small_filesystem(tmp_path / "cache", 2**20) as cache:
        env = launch_env()
        env["HF_DATASETS_CACHE"] = str(cache)
        result = launch_train(FSDP2, tmp_path / "out", ["--model_name_or_path", str(tiny.model_dir),
                                                        "--dataset_name", str(data), *FLAGS, "--max_steps", "2",
                                                        "--save_strategy", "no"], env=env)
    assert result.returncode == 0, result.output[-4000:]
    assert result.output.count(f"datasets could not write its cache in {cache}") == 1, result.output[-4000:]
    assert "point HF_DATASETS_CACHE at a folder with room" in result.output and "disk full" not in result.output
    assert (result.record["data"]["prepared_on_ranks"], result.record["data"]["read_copy_on_ranks"]) == ([0], [1])
    temporary = re.search(r"this launch prepares the data in (\S+) \(removed at exit\)", result.output).group(1)
    assert not os.path.exists(temporary), temporary  # removed, also where the ranks exit skipping the teardown
