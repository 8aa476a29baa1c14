"""Preemption and faults lose nothing.

- SIGTERM / SIGUSR1 sent to ONE rank of a 2-rank FSDP run (rank 1, then rank 0 of the resumed run): all ranks stop
  at the same step, write a complete checkpoint, exit 75 with a message saying how to resume; resuming matches a run
  that was never interrupted.
- SIGKILL of one rank: the launcher and the surviving rank exit within a bounded time, and the last complete
  checkpoint is intact and is what `--resume_from_checkpoint latest` picks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from sft_recipe.artifacts.checkpoints import latest_complete_checkpoint
from tests.helpers import (
    RELATIVE_TOLERANCE,
    REPO,
    accelerate_launch,
    free_port,
    launch_env,
    launch_train,
    open_log,
    rank_pid,
    wait_for_training,
)

FLAGS = ["--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_alpha", "16",
         "--lora_dropout", "0", "--max_steps", "30", "--max_seq_len", "128", "--report_to", "none",
         "--eval_strategy", "no", "--logging_steps", "1", "--seed", "3", "--learning_rate", "3e-3",
         "--packing", "True", "--per_device_train_batch_size", "4"]
CONFIG = "cpu/fsdp2_config.yaml"


def _start(tiny, output_dir, extra):
    cmd = [*accelerate_launch(), "--config_file", str(REPO / "configs" / CONFIG),
           "--main_process_port", str(free_port()), "train.py", "--output_dir", str(output_dir),
           "--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *FLAGS, *extra]
    log = open_log(output_dir.parent / f"{output_dir.name}.log")
    return subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=log, stderr=subprocess.STDOUT, text=True), log


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "full"
    result = launch_train(CONFIG, out, ["--model_name_or_path", str(tiny.model_dir), "--dataset_name",
                                        str(tiny.jsonl_dir), *FLAGS, "--save_strategy", "no"])
    assert result.returncode == 0, result.output[-4000:]
    return result.record["training"]["losses"]


def _preempt(tiny, out, signum, rank, extra) -> int:
    """Start a run into `out`, send `signum` to global rank `rank` once it has trained a step, and check that every
    rank stopped at one step with a complete checkpoint and the resume command; returns that step."""
    launcher, log = _start(tiny, out, ["--save_strategy", "no", *extra])
    try:
        pid = rank_pid(launcher, rank)
        wait_for_training(log, steps=2 if not extra else 1)
        os.kill(pid, signum)
        launcher.wait(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    log.seek(0)
    output = log.read()
    assert launcher.returncode != 0
    assert "exitcode  : 75" in output  # the ranks' own exit code, reported by the launcher
    assert f"preempted: stopped by {signal.Signals(signum).name}" in output or \
        "preempted: stopped by a signal on another rank" in output
    assert "--resume_from_checkpoint latest" in output
    checkpoint, _ = latest_complete_checkpoint(out)
    assert checkpoint is not None, output[-3000:]
    stopped_at = int(checkpoint.name.split("-")[1])
    assert not (out / "adapter_model.safetensors").exists()  # no final adapter from an unfinished run
    assert json.loads((out / "preempted.json").read_text())["global_step"] == stopped_at
    return stopped_at


def test_a_signal_on_either_rank_checkpoints_and_two_preemptions_resume_exactly(tiny, tmp_path, uninterrupted):
    """SIGTERM to rank 1, then SIGUSR1 to rank 0 (the main process) in the resumed run: each stops every rank at
    one step with a complete checkpoint (exit 75); the second resume finishes and matches the uninterrupted run at
    every step after the first stop, the preempted-and-resumed run's steps included. One launch serves both signals:
    each rank's path is still taken, and a resumed run is preempted again."""
    out = tmp_path / "run"
    first = _preempt(tiny, out, signal.SIGTERM, 1, [])
    assert 2 <= first < 30
    second = _preempt(tiny, out, signal.SIGUSR1, 0, ["--resume_from_checkpoint", "latest"])
    assert first < second < 30  # the resumed run trained on from the first stop before the second

    resumed = launch_train(CONFIG, out, ["--model_name_or_path", str(tiny.model_dir), "--dataset_name",
                                         str(tiny.jsonl_dir), *FLAGS, "--save_strategy", "no",
                                         "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-4000:]
    losses = resumed.record["training"]["losses"]
    assert len(losses) == 30 and not (out / "preempted.json").exists()
    for step in range(first, 30):
        assert abs(losses[step] - uninterrupted[step]) <= RELATIVE_TOLERANCE * abs(uninterrupted[step]), step + 1


def test_sigkill_of_one_rank_ends_the_run_and_keeps_the_last_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    launcher, log = _start(tiny, out, ["--save_strategy", "steps", "--save_steps", "2", "--ddp_timeout", "60"])
    try:
        pid = rank_pid(launcher, 1)
        wait_for_training(log, steps=5)
        os.kill(pid, signal.SIGKILL)
        started = time.time()
        launcher.wait(timeout=120)
        elapsed_s = time.time() - started
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0 and elapsed_s < 90
    log.seek(0)
    output = log.read()
    # The survivor says what happened in one line, with the resume command, instead of gloo's traceback; torch's
    # report names the dead rank and its signal.
    assert re.search(r"error: rank 0: another rank is gone \(.*\)\. Its process ended: killed \(SIGKILL, usually "
                     r"the out-of-memory killer", output), output[-4000:]
    assert "--resume_from_checkpoint latest" in output and "[rank0]: Traceback" not in output, output[-4000:]
    assert "exitcode  : -9" in output and "(SIGKILL)" in output
    for child in psutil.Process().children(recursive=True):  # no orphaned rank left running
        assert "train.py" not in " ".join(child.cmdline())
    checkpoint, _ = latest_complete_checkpoint(out)
    assert checkpoint is not None and int(checkpoint.name.split("-")[1]) >= 2
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # both sharded parts were finished (DCP writes .metadata last)
        assert (checkpoint / part / ".metadata").is_file()


def test_kill_during_a_checkpoint_save_leaves_the_previous_one_to_resume_from(tiny, tmp_path):
    """SIGKILL every process while a checkpoint is being written (a folder exists, its completion marker does not):
    the half-written checkpoint is skipped and the previous complete one is what `latest` resumes from."""
    from sft_recipe.artifacts.checkpoints import COMPLETE_MARKER, resolve_resume

    out = tmp_path / "run"
    launcher, log = _start(tiny, out, ["--save_strategy", "steps", "--save_steps", "1"])
    half_written = None
    try:
        deadline = time.time() + 180
        while half_written is None and time.time() < deadline and launcher.poll() is None:
            for path in sorted(out.glob("checkpoint-*")) if out.exists() else []:
                step = int(path.name.split("-")[1])
                if step >= 3 and not (path / COMPLETE_MARKER).exists():
                    for proc in [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(True)]:
                        proc.kill()
                    half_written = path
                    break
            time.sleep(0.002)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert half_written is not None, "never caught a save in progress"
    assert not (half_written / COMPLETE_MARKER).exists(), "the save finished before the kill landed"
    resume_from, problems = resolve_resume("latest", str(out))
    previous = int(half_written.name.split("-")[1]) - 1
    assert not problems and resume_from == str(out / f"checkpoint-{previous}")

    resumed = launch_train(CONFIG, out, ["--model_name_or_path", str(tiny.model_dir), "--dataset_name",
                                         str(tiny.jsonl_dir), *FLAGS, "--save_strategy", "no",
                                         "--resume_from_checkpoint", "latest", "--max_steps", str(previous + 2)])
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.record["training"]["global_steps"] == previous + 2


def test_launch_script_exits_75_when_preempted(tiny, tmp_path):
    """torchrun reports a failed rank as 1; the guide's script turns a preemption back into 75 for requeue wrappers."""
    out = tmp_path / "script"
    env = launch_env()
    env.update(MODEL=str(tiny.model_dir), DATASET=str(tiny.jsonl_dir), OUTPUT_DIR=str(out),
               ACCELERATE_CONFIG="configs/cpu/fsdp2_config.yaml", NUM_PROCESSES="2")
    log = open_log(tmp_path / "script.log")
    script = subprocess.Popen(["bash", "run_peft_fsdp.sh", "--use_flash_attn", "False", "--push_to_hub", "False",
                               "--max_steps", "200", "--max_seq_len", "128", "--per_device_train_batch_size", "2",
                               "--gradient_accumulation_steps", "1", "--logging_steps", "1"],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        pid = rank_pid(script, 1)
        wait_for_training(log, steps=2)
        os.kill(pid, signal.SIGTERM)
        script.wait(timeout=180)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 75
    assert (out / "preempted.json").is_file() and latest_complete_checkpoint(out)[0] is not None
