"""A run stops at a step end, all ranks together, and loses nothing that was checkpointed.

- Divergence (a non-finite loss or gradient norm): every rank stops at that step with exit code 4 and one message
  naming the step, the value, the newest intact checkpoint and the fix; nothing of the broken state is saved; the
  log and the run record show the loss as non-finite (transformers' filter would log it as 0). On 2 ranks the NaN
  comes from ONE rank's data (a token whose embedding row is NaN, in one training row).
- Ctrl-C: the first SIGINT checkpoints and exits 130 with the resume line; a second one aborts at once. Sent as a
  terminal sends it, to the whole process group: of `train.py`, and of the guide's launch script around `accelerate
  launch` with 2 ranks (torchrun runs the ranks in sessions of their own and forwards one SIGINT to each).

Processes start with SIGINT at its default: a job a non-interactive shell starts in the background inherits it
ignored (POSIX), and the recipe keeps an ignored SIGINT ignored (tests/unit/test_stop_at_step_end.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from sft_recipe.artifacts.checkpoints import intact_checkpoints, is_complete
from tests.helpers import REPO, accelerate_launch, free_port, launch_env, open_log, wait_for_training

FLAGS = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0",
         "--lora_target_modules", "all-linear", "--per_device_train_batch_size", "4", "--logging_steps", "1",
         "--packing", "True", "--max_seq_len", "128", "--report_to", "none", "--eval_strategy", "no", "--seed", "3"]


def _start(cmd: list[str], log_path, env=None) -> tuple[subprocess.Popen, object]:
    """A process group of its own (as a terminal's foreground job) with SIGINT at its default."""
    log = open_log(log_path)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or launch_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def _train_cmd(tiny, out, *extra, model=None, dataset=None) -> list[str]:
    return [sys.executable, "train.py", "--model_name_or_path", str(model or tiny.model_dir), "--dataset_name",
            str(dataset or tiny.jsonl_dir), "--output_dir", str(out), *FLAGS, *extra]


def _finish(proc, log, timeout_s: float = 240) -> str:
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.seek(0)
    return log.read()


# --------------------------------------------------------------------------------------------- divergence


def test_divergence_stops_at_the_step_and_saves_nothing_of_it(tiny, tmp_path):
    """lr 1e30: step 1 is finite, its update makes step 2's loss NaN. A checkpoint every step: checkpoint-1 stays
    (intact, but its weights are the ones that broke step 2: passed over, and no earlier one exists); the step-2
    save, the final adapter and any later step never happen."""
    out = tmp_path / "run"
    proc, log = _start(_train_cmd(tiny, out, "--learning_rate", "1e30", "--max_steps", "6", "--save_strategy",
                                  "steps", "--save_steps", "1"), tmp_path / "run.log")
    output = _finish(proc, log)
    assert proc.returncode == 4, output[-3000:]
    match = re.search(r"diverged: training diverged at step (\d+): (.*?) \(fp32\)\. Stopped there", output)
    assert match, output[-3000:]
    step = int(match.group(1))
    assert step >= 2 and "loss nan" in match.group(2)
    assert f"{out / f'checkpoint-{step - 1}'} is intact but holds the weights that produced this step's " \
           "non-finite value" in output
    assert "no earlier checkpoint was written before it: start again with the fix" in output
    assert "Fix: a lower --learning_rate (now 1e+30)" in output
    assert "Traceback" not in output
    assert [p.name for p in intact_checkpoints(out)][0] == f"checkpoint-{step - 1}"
    assert not any((out / f"checkpoint-{n}").exists() for n in range(step, 7))  # the broken state was never saved
    assert not (out / "adapter_model.safetensors").exists()
    # The log and the record say NaN where transformers' filter would have said 0.
    logged = re.findall(r"\{'loss': '([^']+)'", output)
    assert logged[-1] == "nan" and "0" not in logged
    record = json.loads((out / "run_record.json").read_text())
    assert math.isnan(record["training"]["losses"][-1]) and record["training"]["global_steps"] == step
    assert (out / "loss_curve.png").is_file()


def test_the_stops_advice_run_as_printed_finishes(tiny, tmp_path):
    """lr 1e30 after a 3-step linear warmup: step 1 trains at rate 0, step 2 at 3.3e29 (finite weights, saved as
    checkpoint-2), step 3 is NaN. The message passes over checkpoint-2 and names checkpoint-1; the same command with
    that --resume_from_checkpoint and the fix it proposes (a lower --learning_rate) trains to the end."""
    out = tmp_path / "run"
    command = _train_cmd(tiny, out, "--learning_rate", "1e30", "--warmup_steps", "3", "--max_steps", "6",
                         "--save_strategy", "steps", "--save_steps", "1")
    proc, log = _start(command, tmp_path / "run.log")
    output = _finish(proc, log)
    assert proc.returncode == 4, output[-3000:]
    assert "training diverged at step 3" in output
    assert f"{out / 'checkpoint-2'} is intact but holds the weights that produced this step's non-finite value" \
        in output, output[-3000:]
    match = re.search(r"resume from it with the fix \(--resume_from_checkpoint (\S+)\)", output)
    assert match and match.group(1) == str(out / "checkpoint-1"), output[-3000:]
    proc, log = _start([*command, "--resume_from_checkpoint", match.group(1), "--learning_rate", "1e-3"],
                       tmp_path / "resumed.log")
    output = _finish(proc, log)
    assert proc.returncode == 0, output[-3000:]
    assert "resume: this launch's settings replace the checkpoint's: --learning_rate 1e+30 -> 0.001" in output
    record = json.loads((out / "run_record.json").read_text())
    assert record["training"]["global_steps"] == 6 and all(map(math.isfinite, record["training"]["losses"][1:]))


def _poison_one_row(tiny, tmp_path):
    """(model folder, data folder): the tiny model with one unused token's embedding row set to NaN, and the tiny
    training data with that token in exactly one row -- so exactly one rank, at one step, sees a NaN loss."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    rows = [json.loads(line) for line in (tiny.jsonl_dir / "train.jsonl").read_text().splitlines()]

    def ids_of(messages):
        return set(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False))["input_ids"])

    used = set().union(*(ids_of(r["messages"]) for r in rows))
    poisoned = rows[0]["messages"]
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        if token_id in used or not piece.strip() or token_id in tokenizer.all_special_ids:
            continue
        candidate = [*poisoned[:-1], {"role": "assistant", "content": poisoned[-1]["content"] + " " + piece}]
        if token_id in ids_of(candidate):
            break
    else:
        raise AssertionError("no unused token survives tokenization in context")
    model = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model)
    weights = load_file(model / "model.safetensors")
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[key][token_id] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    data = tmp_path / "data"
    data.mkdir()
    rows[len(rows) // 2] = {"messages": candidate}
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(tiny.jsonl_dir / "test.jsonl", data / "test.jsonl")
    assert not torch.isfinite(weights[key][token_id]).any()
    return model, data


def test_divergence_on_one_rank_stops_every_rank(tiny, tmp_path):
    """2 FSDP2 ranks; one sees a NaN loss: both stop at that step with exit 4 (none hangs in a collective), the
    message names that rank, and no checkpoint from that step on is written."""
    model, data = _poison_one_row(tiny, tmp_path)
    out = tmp_path / "run"
    train = _train_cmd(tiny, out, "--learning_rate", "3e-3", "--max_steps", "30", "--save_strategy", "steps",
                       "--save_steps", "1", model=model, dataset=data)[1:]
    cmd = [*accelerate_launch(), "--config_file", "configs/cpu/fsdp2_config.yaml",
           "--main_process_port", str(free_port()), *train]
    proc, log = _start(cmd, tmp_path / "run.log")
    output = _finish(proc, log)
    match = re.search(r"diverged: training diverged at step (\d+): (a non-finite loss|loss nan) on rank (\d)", output)
    assert match, output[-4000:]
    step = int(match.group(1))
    assert "exitcode  : 4" in output and "Traceback" not in output.split("diverged:")[0], output[-3000:]
    assert not any((out / f"checkpoint-{n}").exists() for n in range(step, 31))
    assert all(is_complete(out / f"checkpoint-{n}") for n in range(1, step))


# ------------------------------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_checkpoints_and_exits_130(tiny, tmp_path):
    out = tmp_path / "run"
    proc, log = _start(_train_cmd(tiny, out, "--learning_rate", "3e-3", "--max_steps", "2000", "--save_strategy",
                                  "no"), tmp_path / "run.log")
    wait_for_training(log, steps=3)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    output = _finish(proc, log)
    assert proc.returncode == 130, output[-3000:]
    assert "Ctrl-C: every rank finishes this step and writes a checkpoint" in output
    match = re.search(r"interrupted: stopped by Ctrl-C \(SIGINT\) after step (\d+); checkpoint saved to (\S+)\. "
                      r"Resume: run the same command with --resume_from_checkpoint latest", output)
    assert match and "Traceback" not in output, output[-3000:]
    step = int(match.group(1))
    assert [p.name for p in intact_checkpoints(out)] == [f"checkpoint-{step}"]
    assert json.loads((out / "preempted.json").read_text())["signal"] == "SIGINT"


def test_a_second_ctrl_c_aborts_at_once(tiny, tmp_path):
    """The second SIGINT arrives while the step the first one let finish is still running (a step of 200
    micro-batches here): the run ends at once, 130, one line and no traceback, and no checkpoint of it exists."""
    data = tmp_path / "data"
    data.mkdir()
    rows = (tiny.jsonl_dir / "train.jsonl").read_text()
    (data / "train.jsonl").write_text(rows * 20)  # enough rows for long optimizer steps
    shutil.copy(tiny.jsonl_dir / "test.jsonl", data / "test.jsonl")
    out = tmp_path / "run"
    proc, log = _start(_train_cmd(tiny, out, "--learning_rate", "3e-3", "--max_steps", "50", "--save_strategy", "no",
                                  "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "200",
                                  dataset=data), tmp_path / "run.log")
    wait_for_training(log, steps=1)
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.time() + 30
    while "Ctrl-C: every rank finishes" not in (log.seek(0) or log.read()) and time.time() < deadline:
        time.sleep(0.02)  # the first one was taken: the step it lets finish is running now
    os.killpg(proc.pid, signal.SIGINT)
    started = time.time()
    output = _finish(proc, log)
    assert proc.returncode == 130 and time.time() - started < 20, output[-3000:]
    assert "aborted by Ctrl-C: nothing more was saved" in output and "Traceback" not in output, output[-3000:]
    assert "interrupted: stopped by Ctrl-C" not in output and not intact_checkpoints(out)


def test_ctrl_c_to_the_launch_scripts_process_group_checkpoints_every_rank(tiny, tmp_path):
    """`bash run_peft_fsdp.sh` with 2 ranks, Ctrl-C to its process group: the launcher forwards SIGINT to each rank
    and allows them TORCH_ELASTIC_SHUTDOWN_TIMEOUT (the script raises torch's 30 s default); every rank finishes the
    step and the checkpoint, and the script exits 130."""
    out = tmp_path / "script"
    env = launch_env()
    env.update(MODEL=str(tiny.model_dir), DATASET=str(tiny.jsonl_dir), OUTPUT_DIR=str(out),
               ACCELERATE_CONFIG="configs/cpu/fsdp2_config.yaml", NUM_PROCESSES="2")
    proc, log = _start(["bash", "run_peft_fsdp.sh", "--use_flash_attn", "False", "--push_to_hub", "False",
                        "--max_steps", "2000", "--max_seq_len", "128", "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", "1", "--logging_steps", "1"], tmp_path / "script.log", env)
    wait_for_training(log, steps=2)
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    output = _finish(proc, log)
    elapsed_s = time.time() - sent
    assert proc.returncode == 130, output[-4000:]
    assert "forcefully exiting" not in output, output[-4000:]  # no rank was SIGKILLed by the launcher
    assert "The launcher kills the ranks 600 s after Ctrl-C" in output  # the grace the script gave, as the rank read it
    checkpoint = intact_checkpoints(out)[0]
    assert json.loads((out / "preempted.json").read_text())["checkpoint"] == checkpoint.name
    assert elapsed_s < 60, elapsed_s  # a tiny step and checkpoint: well inside the grace
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # every rank's shards were written
        assert (checkpoint / part / ".metadata").is_file()


# ------------------------------------------------------------------------------------------------- SIGHUP


def _read_until(master_fd: int, pattern: str, timeout_s: float = 180) -> str:
    """What the run wrote to its terminal, read from the pty's master side until `pattern` appears."""
    import select

    seen, deadline = b"", time.time() + timeout_s
    while time.time() < deadline and re.search(pattern, seen.decode(errors="replace"), re.S) is None:
        if select.select([master_fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(master_fd, 65536)
            except OSError:  # the child closed the terminal: it has exited
                break
            if not chunk:
                break
            seen += chunk
    return seen.decode(errors="replace")


def test_a_closed_terminal_checkpoints_exits_75_and_keeps_the_rest_of_the_output(tiny, tmp_path):
    """`python train.py` in a terminal of its own (a pty; the run is its session leader, as under ssh), then the
    terminal closes: the kernel sends SIGHUP, and every later write to the terminal would fail (EIO). The run ends
    the step, checkpoints, exits 75, and what it said after the hangup is in output_dir/hangup.log."""
    import pty

    out = tmp_path / "run"
    cmd = _train_cmd(tiny, out, "--learning_rate", "3e-3", "--max_steps", "2000", "--save_strategy", "no")
    env = launch_env()
    pid, master_fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal; SIGHUP at its default, as in a fresh login
        try:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.chdir(REPO)
            os.execve(cmd[0], cmd, env)
        finally:
            os._exit(127)
    try:
        before = _read_until(master_fd, r"'loss'.*'loss'.*'loss'")
        assert before.count("'loss'") >= 3, before[-3000:]
    finally:
        os.close(master_fd)  # the terminal closes: SIGHUP to the session
    deadline, status = time.time() + 120, None
    while time.time() < deadline and status is None:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = code if done else None
        time.sleep(0.1)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    hangup_log = (out / "hangup.log").read_text() if (out / "hangup.log").exists() else ""
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 75, (status, hangup_log[-3000:])
    assert "SIGHUP (the terminal or session closed): every rank finishes this step" in hangup_log
    match = re.search(r"stopped by SIGHUP after step (\d+); checkpoint saved to \S+\. Resume: run the same command "
                      r"with --resume_from_checkpoint latest", hangup_log)
    assert match and "Traceback" not in hangup_log, hangup_log[-3000:]
    step = int(match.group(1))
    assert [p.name for p in intact_checkpoints(out)] == [f"checkpoint-{step}"]
    assert json.loads((out / "preempted.json").read_text())["signal"] == "SIGHUP"


def test_sighup_to_the_launcher_checkpoints_every_rank(tiny, tmp_path):
    """`accelerate launch` with 2 FSDP2 ranks gets the terminal's SIGHUP (the ranks run in sessions of their own):
    torch elastic forwards it to each rank, and every rank finishes the step, checkpoints and exits 75. The launcher
    itself ends with torch's SignalException (exit 1); the run_peft_*.sh scripts turn the note into 75."""
    out = tmp_path / "run"
    cmd = [*accelerate_launch(), "--config_file",
           str(REPO / "configs" / "cpu" / "fsdp2_config.yaml"), "--main_process_port", str(free_port()),
           *_train_cmd(tiny, out, "--learning_rate", "3e-3", "--max_steps", "2000", "--save_strategy", "no")[1:]]
    proc, log = _start(cmd, tmp_path / "run.log")
    wait_for_training(log, steps=2)
    os.kill(proc.pid, signal.SIGHUP)  # the launcher: the terminal's session leader here
    output = _finish(proc, log)
    assert proc.returncode == 1 and "Sending process" in output and "closing signal SIGHUP" in output, output[-4000:]
    assert "SIGHUP (the terminal or session closed): every rank finishes this step" in output
    assert "stopped by SIGHUP after step" in output and "forcefully exiting" not in output, output[-4000:]
    checkpoint = intact_checkpoints(out)[0]
    assert json.loads((out / "preempted.json").read_text()) == {"signal": "SIGHUP", "global_step": int(
        checkpoint.name.split("-")[1]), "checkpoint": checkpoint.name}
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # every rank's shards were written
        assert (checkpoint / part / ".metadata").is_file()
