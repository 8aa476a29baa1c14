"""One run per output_dir, with real 2-rank FSDP2 launches through the real launcher (tiny model, fp32).

- A second launch into the folder of a live run (stopped with SIGSTOP while the second one runs, so "live" does not
  depend on timing) is refused on both ranks with exit code 2 before any weight loads, naming the holder's host,
  process id and start time -- even with --overwrite_output_dir, which would otherwise move the live run's
  checkpoints aside. The first run then finishes with exit 0, its adapter intact, and releases the hold.
- After a SIGKILL of a run's whole process tree (the hold file stays), `--resume_from_checkpoint latest` is not
  blocked: it takes the stale hold over with one line saying so, and finishes.
"""

from __future__ import annotations

import json
import signal

import psutil
from safetensors import safe_open

from sft_recipe.artifacts.checkpoints import checkpoints, latest_complete_checkpoint
from sft_recipe.artifacts.run_hold import HOLD_FILE
from tests.helpers import launch_train, process_tree, rank_pid, start_train, wait_for_training

CONFIG = "cpu/fsdp2_config.yaml"
FLAGS = ["--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_alpha", "16",
         "--lora_dropout", "0", "--max_seq_len", "128", "--report_to", "none", "--eval_strategy", "no",
         "--logging_steps", "1", "--seed", "3", "--learning_rate", "3e-3", "--packing", "True",
         "--per_device_train_batch_size", "4", "--bf16", "False", "--save_strategy", "steps", "--save_steps", "2"]


def _common(tiny, steps):
    return ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir), *FLAGS,
            "--max_steps", str(steps)]


def _hold(out):
    return json.loads((out / HOLD_FILE).read_text())


def _signal_tree(launcher, signum):
    for proc in process_tree(launcher):
        try:
            proc.send_signal(signum)
        except psutil.NoSuchProcess:
            continue


def test_a_second_launch_into_a_live_runs_folder_is_refused_before_any_weight_loads(tiny, tmp_path):
    out = tmp_path / "run"
    first, log = start_train(CONFIG, out, _common(tiny, 4))
    stopped = False
    try:
        rank0 = rank_pid(first, 0)
        wait_for_training(log, steps=2)  # training, its first checkpoint written
        _signal_tree(first, signal.SIGSTOP)  # alive but still: the second launch meets it mid-run, whatever the CPU
        stopped = True
        hold = _hold(out)
        assert hold["pid"] == rank0 and hold["started"]
        before = sorted(p.name for p in checkpoints(out))

        second = launch_train(CONFIG, out, [*_common(tiny, 4), "--overwrite_output_dir", "True"])
        assert second.returncode != 0 and second.output.count("exitcode  : 2") == 2, second.output[-4000:]
        assert f"--output_dir {out}: another run is using this folder (host {hold['host']}, process {rank0}, " \
               f"started {hold['started']}; process {rank0} is running on this host" in second.output
        assert "Fix: wait until that run ends" in second.output and "another --output_dir" in second.output
        # No rank loaded a weight or failed otherwise (the launcher's own report of the failed ranks is a traceback).
        assert "Loading weights" not in second.output and "]: Traceback" not in second.output
        assert sorted(p.name for p in checkpoints(out)) == before and not list(out.glob("_previous-run-*"))
        assert _hold(out) == hold  # the live run's hold, untouched

        _signal_tree(first, signal.SIGCONT)
        stopped = False
        first.wait(timeout=300)
    finally:
        if stopped:
            _signal_tree(first, signal.SIGCONT)
        if first.poll() is None:
            first.kill()
    log.seek(0)
    output = log.read()
    assert first.returncode == 0, output[-4000:]
    assert "Loading weights" in output  # the marker the refusal's check relies on is printed by a real load
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as adapter:
        assert any("lora_A" in key for key in adapter.keys())
    assert json.loads((out / "run_record.json").read_text())["training"]["global_steps"] == 4
    assert not (out / HOLD_FILE).exists()  # released at the end


def test_a_resume_after_a_sigkill_takes_the_stale_hold_over(tiny, tmp_path):
    out = tmp_path / "run"
    crashed, log = start_train(CONFIG, out, _common(tiny, 30))
    try:
        rank0 = rank_pid(crashed, 0)
        wait_for_training(log, steps=3)
        _signal_tree(crashed, signal.SIGKILL)  # no code runs: the hold file stays behind
        crashed.wait(timeout=60)
    finally:
        if crashed.poll() is None:
            crashed.kill()
    hold = _hold(out)
    assert hold["pid"] == rank0
    checkpoint, _ = latest_complete_checkpoint(out)
    assert checkpoint is not None
    step = int(checkpoint.name.split("-")[1])

    resumed = launch_train(CONFIG, out, [*_common(tiny, step + 2), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"--output_dir {out}: taking over the hold of a run that is gone (host {hold['host']}, process {rank0}, " \
           f"started {hold['started']}): process {rank0} " in resumed.output
    assert resumed.output.count("taking over the hold") == 1
    assert resumed.record["training"]["global_steps"] == step + 2 and not (out / HOLD_FILE).exists()
