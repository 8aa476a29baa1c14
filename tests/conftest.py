"""Shared fixtures: the tiny model/data built once per session, and a helper that launches train.py for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _bin_dir() -> str:
    return str(Path(sys.executable).parent)


def launch_env(cpu_switch: bool = True) -> dict[str, str]:
    """Environment for a launched run: the venv's tools first on PATH, offline, quiet, one thread per rank."""
    env = dict(os.environ)
    env["PATH"] = _bin_dir() + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_TOKEN", None)
    if cpu_switch:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


@dataclass
class RunResult:
    returncode: int
    output: str
    output_dir: Path

    @property
    def facts(self) -> dict:
        return json.loads((self.output_dir / "run_facts.json").read_text())


def run_command(cmd: list[str], output_dir: Path, env: dict | None = None, timeout: int = 600) -> RunResult:
    proc = subprocess.run(cmd, cwd=REPO, env=env or launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    return RunResult(proc.returncode, proc.stdout, output_dir)


def launch_train(config: str, output_dir: Path, args: list[str], env: dict | None = None,
                 launcher_args: tuple[str, ...] = ()) -> RunResult:
    """`accelerate launch --config_file configs/<config> [launcher_args] train.py ...` through the real launcher."""
    return launch_script(config, "train.py", ["--output_dir", str(output_dir), *args], output_dir, env,
                         launcher_args)


def launch_script(config: str, script: str, args: list[str], output_dir: Path, env: dict | None = None,
                  launcher_args: tuple[str, ...] = ()) -> RunResult:
    """`accelerate launch --config_file configs/<config> [launcher_args] <script> ...` through the real launcher."""
    cmd = [os.path.join(_bin_dir(), "accelerate"), "launch", "--config_file", str(REPO / "configs" / config),
           "--main_process_port", str(_free_port()), *launcher_args, script, *args]
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(items):
    """Mark each test by where it lives (markers are declared in pyproject.toml): `-m unit` is the fast lane."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        item.add_marker({"unit": pytest.mark.unit, "e2e": pytest.mark.e2e}.get(parts[0], pytest.mark.cli))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The embedded default (tiny Llama + tokenizer + chat data), built once per test session."""
    from sft_recipe.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"))


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


@pytest.fixture(scope="session")
def format_datasets(tiny, tmp_path_factory):
    """fmt -> folder with train.jsonl/test.jsonl of the tiny conversations in that format (built once)."""
    from transformers import AutoTokenizer

    from sft_recipe.tiny import load_conversations

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.model_dir))
    root = tmp_path_factory.mktemp("formats")
    folders = {}
    for fmt in ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt_completion_chat"):
        folders[fmt] = root / fmt
        folders[fmt].mkdir()
        for split in ("train", "test"):
            rows = [tiny_conversation_as(fmt, m, tokenizer) for m in load_conversations(tiny, split)]
            (folders[fmt] / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folders
