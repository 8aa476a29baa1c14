"""What the tests share: launching the real recipe, the tiny model's flag sets and tolerances, fake launchers.

Tests import from here (never from each other, never private names from conftest); conftest.py keeps the fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# Every launch's datasets cache lives under one folder per test process, removed at the session's end
# (tests/conftest.py calls remove_datasets_caches): a folder per launch left in /tmp filled it (1,660 seen).
_DATASETS_CACHES = tempfile.TemporaryDirectory(prefix="hf-datasets-")


def remove_datasets_caches() -> None:
    """xdist's workers end without running finalizers, so the session's end removes the caches explicitly."""
    _DATASETS_CACHES.cleanup()


def bin_dir() -> str:
    return str(Path(sys.executable).parent)


def accelerate_launch() -> list[str]:
    """`accelerate launch` as its own module: the parser and launch_command the CLI dispatches to, without the CLI
    registering every other subcommand first (its `estimate` imports transformers: 0.7 CPU-s a launch, ~150 in the
    suite), imported without the cyclic collector (tests/accelerate_launcher.py: 0.36 CPU-s more). The run_peft*.sh
    scripts and the README's commands go through the CLI itself (tests/test_scripts.py, tests/test_readme.py,
    tests/test_launch_paths.py)."""
    return [sys.executable, str(REPO / "tests" / "accelerate_launcher.py")]


def launch_env(cpu_switch: bool = True) -> dict[str, str]:
    """Environment for a launched run: the venv's tools first on PATH, offline, quiet, one thread per rank."""
    env = dict(os.environ)
    env["PATH"] = bin_dir() + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_TOKEN", None)
    # A datasets cache of its own: the prepared data one launch keeps (sft_recipe/data/prepared_copy.py) is read by
    # the next only where a test passes the same environment on.
    env["HF_DATASETS_CACHE"] = tempfile.mkdtemp(dir=_DATASETS_CACHES.name)
    if cpu_switch:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


@dataclass
class RunResult:
    returncode: int
    output: str
    output_dir: Path

    @property
    def record(self) -> dict:
        return json.loads((self.output_dir / "run_record.json").read_text())


def run_command(cmd: list[str], output_dir: Path, env: dict | None = None, timeout: int = 600) -> RunResult:
    """Run `cmd` to its end. Past `timeout` it is killed with every process under it, then TimeoutExpired (with
    the output) is raised: subprocess.run's timeout kills the launcher alone, and its ranks lived on, orphaned,
    holding their memory and ports for the rest of the suite (seen under `make coverage`, 2026-12-07: a rank and
    its tokenizing worker, 50 minutes after their test failed)."""
    import psutil

    with subprocess.Popen(cmd, cwd=REPO, env=env or launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for process in process_tree(proc):
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            output, _ = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=output) from None
    return RunResult(proc.returncode, output, output_dir)


def without_loss_curve(args: list[str]) -> list[str]:
    """train.py's flags with `--plot_loss_curve False` added unless they say: drawing loss_curve.png (matplotlib)
    costs the main process ~0.5 CPU-s at every run's end, ~10 % of a one-process launch. The runs the tests read the
    curve of ask for it (`--plot_loss_curve True`: the shared runs, whose curves tests/e2e/test_train.py checks);
    the README's commands and the run_peft*.sh scripts draw it as users' runs do."""
    return list(args) if "--plot_loss_curve" in args else [*args, "--plot_loss_curve", "False"]


def launch_train(config: str, output_dir: Path, args: list[str], env: dict | None = None,
                 launcher_args: tuple[str, ...] = ()) -> RunResult:
    """`accelerate launch --config_file configs/<config> [launcher_args] train.py ...` through the real launcher
    (without the loss curve unless `args` ask for it: `without_loss_curve`)."""
    return launch_script(config, "train.py", ["--output_dir", str(output_dir), *without_loss_curve(args)],
                         output_dir, env, launcher_args)


def open_log(path: Path):
    """A fresh, empty log for a child's output, open for reading too. Opened for appending: the child shares this
    file's offset, so a test that seeks back to read it would otherwise make the child write over its own earlier
    lines (seen: test_multinode's poll never found a line the run had printed). Undecodable bytes -- a read that
    ends inside a progress bar's multi-byte character -- read as replacement characters."""
    open(path, "w").close()
    return open(path, "a+", errors="replace")


def start_train(config: str, output_dir: Path, args: list[str], env: dict | None = None):
    """`launch_train` without waiting: (the launcher's Popen, its log open for reading beside output_dir), for tests
    that act on a run while it trains (signals, a second launch)."""
    cmd = [*accelerate_launch(), "--config_file", str(REPO / "configs" / config), "--main_process_port",
           str(free_port()), "train.py", "--output_dir", str(output_dir), *without_loss_curve(args)]
    log = open_log(output_dir.parent / f"{output_dir.name}.log")
    return subprocess.Popen(cmd, cwd=REPO, env=env or launch_env(), stdout=log, stderr=subprocess.STDOUT,
                            text=True), log


def rank_pid(launcher: subprocess.Popen, rank: int, timeout_s: float = 120) -> int:
    """The process id of global rank `rank` of a run `launcher` started, once it exists."""
    import psutil

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "train.py" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def process_tree(launcher: subprocess.Popen) -> list:
    """The launcher and every process under it (psutil.Process objects), to signal a whole run at once."""
    import psutil

    root = psutil.Process(launcher.pid)
    return [root, *root.children(recursive=True)]


def start_two_machines(config: str, script: str, args: list[str], log_dir: Path, env: dict | None = None,
                       launcher_args: tuple[str, ...] = ()) -> list[tuple[subprocess.Popen, object]]:
    """Two "machines" on this computer over loopback: `accelerate launch --config_file configs/<config>
    --num_machines 2 --machine_rank 0|1 ...` started at once, each with an environment of its own (its own datasets
    cache: `env` is added to a fresh launch_env()). Returns (launcher, its log open for reading) per machine."""
    if script == "train.py":
        args = without_loss_curve(args)
    port = str(free_port())
    machines = []
    for machine_rank in (0, 1):
        log = open_log(log_dir / f"machine-{machine_rank}.log")
        cmd = [*accelerate_launch(), "--config_file", str(REPO / "configs" / config),
               "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank),
               "--main_process_ip", "127.0.0.1", "--main_process_port", port, *launcher_args, script, *args]
        machines.append((subprocess.Popen(cmd, cwd=REPO, env={**launch_env(), **(env or {})}, stdout=log,
                                          stderr=subprocess.STDOUT), log))
    return machines


def launch_two_machines(config: str, script: str, args: list[str], log_dir: Path, env: dict | None = None,
                        launcher_args: tuple[str, ...] = (), timeout_s: float = 300) -> list[str]:
    """`start_two_machines`, waited for. Returns each machine's log; asserts both exited 0."""
    machines = start_two_machines(config, script, args, log_dir, env, launcher_args)
    logs = wait_for_machines(machines, timeout_s)
    for (proc, _), log in zip(machines, logs):
        assert proc.returncode == 0, log[-4000:]
    return logs


def wait_for_machines(machines: list, timeout_s: float = 300) -> list[str]:
    """Wait for every launcher of `start_two_machines` (killing any still running after `timeout_s`); their logs."""
    try:
        for proc, _ in machines:
            proc.wait(timeout=timeout_s)
    finally:
        for proc, _ in machines:
            if proc.poll() is None:
                proc.kill()
    logs = []
    for _, log in machines:
        log.seek(0)
        logs.append(log.read())
    return logs


def launch_script(config: str, script: str, args: list[str], output_dir: Path, env: dict | None = None,
                  launcher_args: tuple[str, ...] = ()) -> RunResult:
    """`accelerate launch --config_file configs/<config> [launcher_args] <script> ...` through the real launcher."""
    cmd = [*accelerate_launch(), "--config_file", str(REPO / "configs" / config),
           "--main_process_port", str(free_port()), *launcher_args, script, *args]
    return run_command(cmd, output_dir, env)


FAKE_LAUNCHER = """#!/usr/bin/env bash
# Records how a launch script calls its launcher (argv as JSON lines) instead of running anything.
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$FAKE_LAUNCH_LOG"
"""


def script_train_flags(script: str, tmp_path: Path, **env_overrides: str) -> tuple[list[str], list[str]]:
    """(launcher words, train.py flags) that `bash <script>` passes, with fake accelerate/torchrun/python recording
    them: what the script really runs, its shared shell included (scripts/lib/launch_common.sh)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("accelerate", "torchrun", "python"):
        (bin_dir / name).write_text(FAKE_LAUNCHER)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "fake-launch.jsonl"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATASET", "OUTPUT_DIR", "ACCELERATE_CONFIG",
                                                              "NUM_PROCESSES", "LAUNCH_ARGS", "PYTHON")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_LAUNCH_LOG=str(log), **env_overrides)
    proc = subprocess.run(["bash", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (argv,) = [json.loads(line) for line in log.read_text().splitlines()]
    return argv[:argv.index("train.py")], argv[argv.index("train.py") + 1:]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Parity between setups that should train the same (tests/e2e/test_parity.py measures it).
RELATIVE_TOLERANCE = 1e-5

TRAIN_FLAGS = [
    "--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
    "--lora_target_modules", "all-linear", "--max_steps", "8", "--per_device_train_batch_size", "4",
    "--learning_rate", "3e-3", "--logging_steps", "1", "--packing", "True", "--max_seq_len", "128",
    "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no", "--seed", "7",
    "--gradient_checkpointing", "True", "--use_reentrant", "False",
]
QLORA_FLAGS = [
    "--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_quant_type", "nf4",
    "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16", "True", "--use_reentrant", "True",  # as the guide
    # fp32 compute: bf16 matmuls are emulated on this CPU (~20x slower); storage stays bf16 as in the guide.
    "--bnb_4bit_compute_dtype", "float32",
]

# A short QLoRA run with the guide's 4-bit settings, small enough for 4 CPU ranks (tests/e2e/test_quantized_load.py
# and test_quantized_once.py): fp32 compute (bf16 matmuls are emulated on this CPU, ~20x slower), bf16 storage.
SMALL_QLORA_FLAGS = [
    "--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0",
    "--lora_target_modules", "all-linear", "--use_4bit_quantization", "True", "--use_nested_quant", "True",
    "--bnb_4bit_quant_type", "nf4", "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bf16", "True",
    "--bnb_4bit_compute_dtype", "float32", "--chat_template_format", "none", "--max_seq_len", "32",
]
SMALL_QLORA_TRAIN_FLAGS = [
    *SMALL_QLORA_FLAGS, "--max_steps", "3", "--per_device_train_batch_size", "1", "--logging_steps", "1",
    "--learning_rate", "1e-2", "--packing", "True", "--use_reentrant", "True", "--report_to", "none",
    "--save_strategy", "no", "--eval_strategy", "no", "--seed", "5",
]


def assert_losses_match(losses: list[float], reference: list[float], steps: int,
                        tolerance: float = RELATIVE_TOLERANCE) -> None:
    """Both runs logged `steps` losses, each within `tolerance` (relative) of the reference's at that step."""
    assert len(losses) == len(reference) == steps, (losses, reference)
    for step, (a, b) in enumerate(zip(losses, reference), start=1):
        assert abs(a - b) <= tolerance * abs(b), f"step {step}: {a} vs {b}"


def wait_for_training(log, steps: int, timeout_s: float = 180) -> None:
    """Until the run has logged `steps` losses (so the signal lands mid-training)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        log.seek(0)
        if log.read().count("'loss'") >= steps:
            return
        time.sleep(0.1)
    log.seek(0)
    raise AssertionError("training never started:\n" + log.read()[-4000:])


def reference_and_merged_logits(adapter_dir, merged_dir, ids, dtype=torch.float32):
    """(PeftModel(base, adapter) logits, logits of the merged folder loaded the plain way, merged model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir))
    base_dir = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    if len(tokenizer) > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))  # no dtype, no PEFT: what a user does
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits.float()
        reference = PeftModel.from_pretrained(base, str(adapter_dir))(input_ids=ids).logits.float()
        merged_logits = merged(input_ids=ids).logits.float()
    return base_logits, reference, merged_logits, merged


# Slurm without Slurm: tests/test_slurm.py and tests/e2e/test_multinode.py run run_peft_slurm.sh with these.
JOB_ID = "4242"

FAKE_SRUN = r"""#!/usr/bin/env bash
# Fake srun: record the options, then start the command once per node, concurrently, with that task's ids.
printf '%s\n' "$*" >> "$SHIM_LOG/srun.args"
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
# Fake scontrol: `show hostnames LIST` prints SHIM_HOSTS one a line; `requeue JOBID` is recorded.
case "$1" in
  show) printf '%s\n' $SHIM_HOSTS ;;
  requeue) echo "$2" >> "$SHIM_LOG/requeue" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

# Fake accelerate: records what one node would launch. SHIM_PREEMPT=1: machine 0 behaves like a preempted run
# (train.py writes preempted.json; the launcher then exits 1). SHIM_EXIT=N: every node exits N.
FAKE_ACCELERATE = r"""
import json, os, signal, sys
from pathlib import Path
argv = sys.argv[1:]
train_args = argv[argv.index("train.py") + 1:]
output_dir = [train_args[i + 1] for i, a in enumerate(train_args) if a == "--output_dir"][-1]
rank = os.environ["SLURM_PROCID"]
record = {"argv": argv, "slurm_procid": rank, "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN}
Path(os.environ["SHIM_LOG"], f"accelerate-{rank}.json").write_text(json.dumps(record))
if os.environ.get("SHIM_PREEMPT") == "1" and rank == "0":
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    Path(output_dir, "preempted.json").write_text(json.dumps({"signal": "SIGUSR1", "global_step": 7}))
    sys.exit(1)
sys.exit(int(os.environ.get("SHIM_EXIT", "0")))
"""


def write_shims(folder: Path, accelerate: bool = True) -> None:
    """Fake srun and scontrol (and accelerate unless the real one is wanted) in bin_dir."""
    folder.mkdir(parents=True, exist_ok=True)
    shims = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL}
    if accelerate:
        shims["accelerate"] = f"#!{sys.executable}" + FAKE_ACCELERATE
    for name, text in shims.items():
        path = folder / name
        path.write_text(text)
        path.chmod(0o755)


def slurm_env(tmp_path: Path, nodes: int, hosts: list[str], **extra: str) -> dict[str, str]:
    """What sbatch sets for a batch job (a subset), plus the shims' log folder, and the shims first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}", SHIM_LOG=str(tmp_path / "log"),
               SHIM_HOSTS=" ".join(hosts), SLURM_JOB_ID=JOB_ID, SLURM_NNODES=str(nodes),
               SLURM_JOB_NODELIST=f"fakelist[{nodes}]", SLURM_SUBMIT_DIR=str(REPO),
               OUTPUT_DIR=str(tmp_path / "out"))
    env.update(extra)
    (tmp_path / "log").mkdir(exist_ok=True)
    return env


def tiny_conversation_as(fmt: str, messages: list[dict], tokenizer=None) -> dict:
    """One tiny conversation (system?, user, assistant) as a row of another dataset format."""
    *context, answer = messages
    if fmt == "messages":
        return {"messages": messages}
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}
    if fmt == "alpaca":
        system = [m["content"] for m in context if m["role"] == "system"]
        return {"instruction": context[-1]["content"], "input": "", "output": answer["content"],
                **({"system": system[0]} if system else {})}
    if fmt == "prompt_completion_chat":
        return {"prompt": context, "completion": [answer]}
    if fmt == "prompt_completion":  # standard: the prompt as the chat template renders it, up to the answer
        return {"prompt": tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=False),
                "completion": answer["content"]}
    raise ValueError(fmt)


# The guide's LoRA flags, a two-step CPU run: the damaged-file tests run train.py with them.
GUIDE_LORA = ["--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear",
              "--max_steps", "2", "--report_to", "none", "--bf16", "False", "--eval_strategy", "no"]


class WeightsLoaded(Exception):
    """Raised by `run_train_in_process` instead of loading weights: the run got past every check."""


def run_train_in_process(argv: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """(exit code, or "weights" where the run reached `from_pretrained`; stderr) of train.py's entry point run in
    this process with `from_pretrained` replaced by a tripwire: what is refused before any weight loads, and how."""
    from transformers import AutoModelForCausalLM

    import train
    from sft_recipe.config.launch_env import LaunchEnv

    def tripwire(*args, **kwargs):
        raise WeightsLoaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", tripwire)
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    capsys.readouterr()
    try:
        code = train.run(LaunchEnv())
    except WeightsLoaded:
        code = "weights"
    return code, capsys.readouterr().err
