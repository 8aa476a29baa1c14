"""The launches tests share: each runs once per test session, on first use, and every test that needs it reads it.

A launch of `train.py` costs 10-15 s on the 2-core machine (docs/testing.md: mostly the libraries' imports), and
most of the suite's time is launches. A test that needs a trained adapter, a checkpoint, a log or a run record asks
the `shared_run` fixture (tests/conftest.py) for a run of this table by name instead of launching its own:

    def test_the_adapter_merges(shared_run, tmp_path):
        run = shared_run("lora-fsdp1")      # RunResult: returncode, output, output_dir, record
        assert run.returncode == 0, run.output[-4000:]

Readers never write into `run.output_dir`: a test that changes files copies them first (shutil.copytree into its
tmp_path). The fixture checks at the end of the session that every shared folder is as its launch left it, so a
reader that writes fails there. To add a reader, ask for an existing run; to add a run, add a row here only when no
row launches what the test needs (docs/testing.md: what a new launch costs).
"""

from __future__ import annotations

import fcntl
import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import QLORA_FLAGS, TRAIN_FLAGS, RunResult, launch_env, launch_train

# A logged-in user's token: what the shared runs write must never contain it (tests/e2e/test_train.py reads them).
SECRET_TOKEN = "hf_testSECRETtoken0123456789"


@dataclass(frozen=True)
class SharedLaunch:
    """`accelerate launch --config_file configs/<config> train.py <flags>`, with the tiny bundle's paths filled in:
    {model}, {jsonl}, {disk}, {parquet}, {text} (tests/conftest.py `tiny`)."""

    config: str
    flags: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cpu_switch: bool = True  # ACCELERATE_USE_CPU=true; DeepSpeed on CPU runs without it (tests/test_deepspeed.py)

    def train_args(self, tiny) -> list[str]:
        paths = {"model": tiny.model_dir, "jsonl": tiny.jsonl_dir, "disk": tiny.disk_dir,
                 "parquet": tiny.parquet_dir, "text": tiny.text_dir}
        return [flag.format(**{k: str(v) for k, v in paths.items()}) for flag in self.flags]

    def flag(self, name: str, default: str | None = None) -> str | None:
        """The value the run's command line gives `name` (the last one, as the parser reads it)."""
        values = [b for a, b in zip(self.flags, self.flags[1:]) if a == name]
        return values[-1] if values else default


def _tiny(dataset: str, chat_format: str, *extra: str) -> tuple[str, ...]:
    return ("--model_name_or_path", "{model}", "--dataset_name", "{" + dataset + "}", "--chat_template_format",
            chat_format, *TRAIN_FLAGS, *extra)


# The runs that also report to TensorBoard: test_integrations reads their event files (one engine each).
TENSORBOARD = ("--report_to", "tensorboard")


# Checkpoints every 4 of the 8 steps: the checkpoint readers (adapter checks, resumes, generation configs) share them.
CHECKPOINTS = ("--save_strategy", "steps", "--save_steps", "4")
LOGGED_IN = {"HF_TOKEN": SECRET_TOKEN}

# name -> launch. The first ten are tests/e2e/test_train.py's engine x feature cells; their readers are listed
# beside each (grep the name to find them all).
SHARED_LAUNCHES: dict[str, SharedLaunch] = {
    # test_train; test_checkpoint_adapters_are_verified_too (its checkpoints and a resume from checkpoint-4);
    # test_adapter_trained_further (its adapter, trained further on every engine); test_resume_damaged (its
    # checkpoints, damaged in copies)
    "lora-single": SharedLaunch("cpu/single.yaml", _tiny("jsonl", "chatml", *CHECKPOINTS), LOGGED_IN),
    # test_train; test_merge_after_training (FSDP1 + chatml merge); test_generation_stops (sharded checkpoints);
    # test_integrations (TensorBoard under FSDP1)
    "lora-fsdp1": SharedLaunch("cpu/fsdp_config.yaml", _tiny("disk", "chatml", *CHECKPOINTS, *TENSORBOARD),
                               LOGGED_IN),
    "lora-fsdp2": SharedLaunch("cpu/fsdp2_config.yaml", _tiny("parquet", "zephyr", "--assistant_only_loss", "True"),
                               LOGGED_IN),
    # test_train; test_merge_after_training (QLoRA merge into the bf16 base); test_adapter_trained_further (FSDP2);
    # test_integrations (TensorBoard from QLoRA on one process)
    "qlora-single": SharedLaunch("cpu/single.yaml", _tiny("jsonl", "none", *QLORA_FLAGS, *TENSORBOARD), LOGGED_IN),
    # test_train; test_resume (its checkpoint-4 resumed: exact on the 4-bit base)
    "qlora-fsdp1": SharedLaunch("cpu/fsdp_config.yaml", _tiny("text", "none", *QLORA_FLAGS, "--dataset_text_field",
                                                              "content", *CHECKPOINTS), LOGGED_IN),
    # FSDP2 keeps cpu_ram_efficient_loading on: QLoRA + chatml resize with non-main ranks loading on meta.
    # test_train; test_resume; test_integrations
    "qlora-fsdp2": SharedLaunch("cpu/fsdp2_config.yaml",
                                _tiny("jsonl", "chatml", *QLORA_FLAGS, *CHECKPOINTS, *TENSORBOARD), LOGGED_IN),
    # DoRA (guide note 5) on all three engines; QDoRA = DoRA over the 4-bit base (refused under FSDP).
    "dora-single": SharedLaunch("cpu/single.yaml", _tiny("jsonl", "none", "--use_dora", "True"), LOGGED_IN),
    "dora-fsdp1": SharedLaunch("cpu/fsdp_config.yaml", _tiny("jsonl", "chatml", "--use_dora", "True"), LOGGED_IN),
    "dora-fsdp2": SharedLaunch("cpu/fsdp2_config.yaml", _tiny("jsonl", "none", "--use_dora", "True"), LOGGED_IN),
    "qdora-single": SharedLaunch("cpu/single.yaml", _tiny("jsonl", "none", *QLORA_FLAGS, "--use_dora", "True"),
                                 LOGGED_IN),
    # DeepSpeed ZeRO-3 on CPU (gloo, fp32, no CPU switch). tests/test_deepspeed.py (against FSDP2 on the same flags);
    # test_integrations (TensorBoard under ZeRO-3)
    "lora-zero3": SharedLaunch("cpu/deepspeed_config.yaml",
                               _tiny("jsonl", "none", "--ddp_backend", "gloo", "--bf16", "False", *TENSORBOARD),
                               cpu_switch=False),
}


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under folder: what a reader must leave as it found it."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


class SharedRuns:
    """Launches each SHARED_LAUNCHES row on first use, once per session, and hands every caller the same result.

    Under pytest-xdist the workers share `root`: the first worker to ask launches while holding a lock on the run,
    and writes its result beside the folder; the others wait on the lock and read that.
    """

    def __init__(self, tiny, root: Path, launches: dict[str, SharedLaunch] = SHARED_LAUNCHES):
        self.tiny, self.root, self.launches = tiny, root, launches
        self.root.mkdir(parents=True, exist_ok=True)
        self._results: dict[str, RunResult] = {}

    def __call__(self, name: str) -> RunResult:
        if name not in self._results:
            output_dir, result_file = self.root / name, self.root / f"{name}.result.json"
            with open(self.root / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # held while launching: another worker waits, then reads
                if not result_file.exists():
                    launch = self.launches[name]
                    # TensorBoard writes under output_dir/runs/ unless the caller's environment sends it elsewhere
                    env = {k: v for k, v in {**launch_env(launch.cpu_switch), **launch.env}.items()
                           if k != "TENSORBOARD_LOGGING_DIR"}
                    # Each draws its loss curve, as a user's run does (tests/e2e/test_train.py checks it on every
                    # engine); the launches its readers derive from train_args do not (tests.helpers.launch_train).
                    result = launch_train(launch.config, output_dir,
                                          [*launch.train_args(self.tiny), "--plot_loss_curve", "True"], env=env)
                    snapshot = _snapshot(output_dir) if output_dir.exists() else {}
                    result_file.write_text(json.dumps({"returncode": result.returncode, "output": result.output,
                                                       "snapshot": snapshot}))
            saved = json.loads(result_file.read_text())
            self._results[name] = RunResult(saved["returncode"], saved["output"], output_dir)
        return self._results[name]

    def changed(self) -> list[str]:
        """The shared runs whose folder a reader changed (files added, removed or rewritten), with what changed."""
        problems = []
        for name in self._results:
            before = {path: tuple(v) for path, v in
                      json.loads((self.root / f"{name}.result.json").read_text())["snapshot"].items()}
            after = _snapshot(self.root / name) if (self.root / name).exists() else {}
            if after != before:
                diff = sorted(set(before.items()) ^ set(after.items()))
                problems.append(f"{name}: {[path for path, _ in diff][:5]}")
        return problems
