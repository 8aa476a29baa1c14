"""Several machines, on one computer over loopback: the real launcher, real rendezvous, real training.

- Two `accelerate launch` processes started at once, one per "machine" (--num_machines 2 --machine_rank 0/1
  --main_process_ip 127.0.0.1), train exactly what one machine with the same two ranks trains: same per-step losses,
  same adapter.
- run_peft_slurm.sh under fake `srun`/`scontrol` (tests/test_slurm.py) with the real launcher: SIGUSR1 to every
  process of the job step (what `#SBATCH --signal=USR1@300` does) checkpoints, requeues and exits 75; the requeued
  job resumes from that checkpoint and finishes.
- A rank SIGKILLed on one machine before training: the other machine's rank ends with one line, no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import torch
from safetensors.torch import load_file

from tests.helpers import (
    JOB_ID,
    RELATIVE_TOLERANCE,
    REPO,
    free_port,
    launch_env,
    launch_train,
    launch_two_machines,
    open_log,
    slurm_env,
    start_two_machines,
    wait_for_machines,
    wait_for_training,
    write_shims,
)

FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
         "--lora_target_modules", "all-linear", "--max_steps", "8", "--per_device_train_batch_size", "4",
         "--learning_rate", "3e-3", "--logging_steps", "1", "--packing", "True", "--max_seq_len", "128",
         "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no", "--seed", "7",
         "--gradient_checkpointing", "True", "--use_reentrant", "False", "--chat_template_format", "none"]
MULTI_NODE_CPU_CONFIG = "configs/cpu/multi_node_fsdp_config.yaml"


def test_two_machines_over_loopback_train_what_one_machine_trains(tiny, tmp_path):
    data = ["--model_name_or_path", str(tiny.model_dir), "--dataset_name", str(tiny.jsonl_dir)]
    out = tmp_path / "two-machines"
    logs = launch_two_machines(MULTI_NODE_CPU_CONFIG.removeprefix("configs/"), "train.py",
                               ["--output_dir", str(out), *data, *FLAGS], tmp_path)

    reference = launch_train("cpu/fsdp_config.yaml", tmp_path / "one-machine", [*data, *FLAGS])
    assert reference.returncode == 0, reference.output[-4000:]

    facts = json.loads((out / "run_record.json").read_text())
    how = facts["distribution"]
    assert (how["distributed_type"], how["fsdp_version"], how["num_processes"]) == ("FSDP", 1, 2)
    # Global rank 0 (the main process: summary, adapter check) ran on machine 0, as --machine_rank asked.
    assert "run summary:" in logs[0] and "run summary:" not in logs[1]
    # Once per machine: each machine has a datasets cache of its own here, so each machine's local main prepared it.
    assert facts["data"]["prepared_on_ranks"] == [0, 1] and facts["data"]["read_copy_on_ranks"] == []
    losses, reference_losses = facts["training"]["losses"], reference.record["training"]["losses"]
    assert len(losses) == len(reference_losses) == 8
    for step, (a, b) in enumerate(zip(losses, reference_losses), start=1):
        assert abs(a - b) <= RELATIVE_TOLERANCE * abs(b), f"step {step}: {a} vs {b}"
    adapter = load_file(str(out / "adapter_model.safetensors"))
    reference_adapter = load_file(str(reference.output_dir / "adapter_model.safetensors"))
    assert adapter.keys() == reference_adapter.keys() and adapter
    for key, tensor in adapter.items():
        torch.testing.assert_close(tensor, reference_adapter[key], rtol=RELATIVE_TOLERANCE, atol=1e-6, msg=key)


def _step_processes(script: subprocess.Popen) -> list[psutil.Process]:
    """What Slurm counts as the job step: every launcher and rank (not the batch shell, not srun)."""
    procs = []
    for child in psutil.Process(script.pid).children(recursive=True):
        try:
            program = child.cmdline()[:3]  # [python, .../accelerate, launch] or [python, -u, train.py]
        except psutil.Error:
            continue
        if any(arg.endswith("/accelerate") or arg == "train.py" for arg in program):
            procs.append(child)
    return procs


def test_slurm_script_preempted_by_usr1_requeues_then_resumes(tiny, tmp_path):
    steps = 20
    write_shims(tmp_path / "bin", accelerate=False)  # fake srun/scontrol, the real launcher
    # 20 steps: the signal lands after step 2 and every rank stops at the next step end it agrees on, a few steps
    # later; the requeued job trains the rest (40 cost 12 more CPU-s for the same paths)
    cpu_flags = ["--bf16", "False", "--use_flash_attn", "False", "--push_to_hub", "False", "--max_steps", str(steps),
                 "--max_seq_len", "128", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                 "--logging_steps", "1", "--eval_strategy", "no", "--chat_template_format", "none"]

    def env_for(**extra):
        env = launch_env()
        env.update(slurm_env(tmp_path, 2, ["127.0.0.1", "127.0.0.1"], GPUS_PER_NODE="1",
                             ACCELERATE_CONFIG=MULTI_NODE_CPU_CONFIG, MAIN_PROCESS_PORT=str(free_port()),
                             MODEL=str(tiny.model_dir), DATASET=str(tiny.jsonl_dir), **extra))
        env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{launch_env()['PATH']}"
        return env

    out = tmp_path / "out"
    log = open_log(tmp_path / "job.log")
    script = subprocess.Popen(["bash", str(REPO / "run_peft_slurm.sh"), *cpu_flags], cwd=tmp_path, env=env_for(),
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_training(log, 2)
        step = _step_processes(script)
        assert len(step) >= 4, "two launchers and two ranks"
        for proc in step:
            proc.send_signal(signal.SIGUSR1)
        script.wait(timeout=180)
    finally:
        if script.poll() is None:
            script.kill()
    log.seek(0)
    output = log.read()
    assert script.returncode == 75, output[-4000:]
    assert (tmp_path / "log" / "requeue").read_text().split() == [JOB_ID]
    assert "preempted: stopped by SIGUSR1" in output
    stopped_at = sorted(out.glob("checkpoint-*/checkpoint_complete.json"))
    assert stopped_at, "a complete checkpoint to resume from"

    # The requeued job: same command, Slurm counts the restart; it resumes by itself and finishes.
    resumed = subprocess.run(["bash", str(REPO / "run_peft_slurm.sh"), *cpu_flags], cwd=tmp_path,
                             env=env_for(SLURM_RESTART_COUNT="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    facts = json.loads((out / "run_record.json").read_text())
    assert facts["training"]["global_steps"] == steps
    preempted_at = max(int(marker.parent.name.split("-")[1]) for marker in stopped_at)
    assert 2 <= preempted_at < steps, preempted_at
    assert resumed.stdout.count("'loss'") == steps - preempted_at, "the requeued job trained only the steps left"
    assert "adapter check OK" in resumed.stdout
    assert not (out / "preempted.json").exists()
    assert (tmp_path / "log" / "requeue").read_text().split() == [JOB_ID], "no second requeue"


def test_a_rank_killed_before_training_on_another_machine_ends_the_run_with_one_line(tiny, tmp_path):
    """Machine 1's rank is SIGKILLed (the out-of-memory killer) while machine 0's rank prepares the data (4,000
    rows), so before training: machine 0's rank, waiting for it in the data's hand-over, ends within seconds with one
    line (which rank, the likely cause, "run the same command again"), no traceback of its own; each machine's
    launcher exits non-zero. Before, only a loss inside training was said in one line."""
    data = tmp_path / "data"
    data.mkdir()
    rows = (tiny.jsonl_dir / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(rows * (4000 // len(rows) + 1)) + "\n")
    machines = start_two_machines(MULTI_NODE_CPU_CONFIG.removeprefix("configs/"), "train.py", [
        "--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(tiny.model_dir), "--dataset_name",
        str(data), "--splits", "train", *FLAGS], tmp_path)
    (machine0, log0), (machine1, _) = machines
    try:
        deadline = time.monotonic() + 120
        while "data: tokenizing split 'train'" not in (seen := log0.read()) and time.monotonic() < deadline:
            log0.seek(0)
            time.sleep(0.05)
        assert "data: tokenizing split 'train'" in seen, f"machine 0 never prepared the data: {seen[-3000:]}"
        rank1 = [p for p in psutil.Process(machine1.pid).children(recursive=True) if "train.py" in p.cmdline()]
        assert len(rank1) == 1, "machine 1's rank, alive while machine 0 prepares the data"
        rank1[0].kill()
        killed = time.monotonic()
    except BaseException:  # failed before its kill: stop both machines, report that failure
        for proc, _ in machines:
            proc.kill()
        raise
    outputs = wait_for_machines(machines, 120)
    ended_in_s = time.monotonic() - killed
    assert machine0.returncode != 0 and machine1.returncode != 0, outputs[0][-3000:]
    assert ended_in_s < 60, ended_in_s
    assert "error: rank 0: another rank is gone (" in outputs[0], outputs[0][-4000:]
    assert "Training had not started, nothing was written: run the same command again." in outputs[0]
    assert "[rank0]: Traceback" not in outputs[0] and "training loss" not in outputs[0]
    assert "exitcode  : -9" in outputs[1] and "(SIGKILL)" in outputs[1], outputs[1][-3000:]
